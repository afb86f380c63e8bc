"""`rlkv eval --engine vllm`: the methods vLLM can serve run there, each head split on an engine of its own.

On vLLM (rlkv's plugin, `rlkv.vllm_plugin`) run `full` (the stock model) and the head-mask methods
(`rlkv`, `ablation-mask`, `random-mask[@K]`, `duo`) in the transformers engine's form: every head reads the
whole prompt, then a compressed head keeps its sink (16) and last window (64) tokens (the plugin's
sink/window KV cache group); with `EvalConfig.window_only`, a sliding window of sink + window tokens, sink
0, the prompt included, on both engines; under `protect_prompt` the compressed heads also keep the whole
prompt, on both engines. Token-eviction methods whose policy the plugin's eviction group runs (`rkv`,
`snapkv`, `h2o`, `random-evict`, `sink-recent`, `knorm`, and `<mask>+<policy>` of those) run on vLLM with the
same `CompressionConfig` (budget, sink, window, buffer, prompt) and rlkv's own schedule and scoring; the others
(`rpc`, `skipkv`) stay on the transformers engine in the same run, and each row records its `engine`.

Rows are written as their requests finish (continuous batching over a task's whole problem list, so the
resume unit is the row); a row's `seconds` is the wall time since the task's previous row, so a cell's rows
sum to its generation time. The stop rules and the repetition early stop are those of the transformers
engine, checked after every decode step (a stopped request is aborted and its blocks freed).
KV memory of a vLLM row (`kv_tokens`): the entries its heads hold for its cached tokens (all but the last
generated one), full heads every token, compressed heads sink + window (an evicting policy: its budget at
that length, after a compaction): what the transformers engine's cache reports for the same row (no
resident bytes: vLLM's blocks are pooled across rows).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rlkv.eval.error_modes import RepetitionRule
from rlkv.eval.methods import parse_method
from rlkv.eval.rows import RowContext, eval_row
from rlkv.eval.stopping import StopRule, closes_first_code_block

# how often the repetition early stop looks at a row, as `RepetitionStop`'s default
REPETITION_CHECK_EVERY = 16


def runs_on_vllm(method: str) -> bool:
    """Whether `method` has a vLLM form: `full`, a head mask with sink + local compressed heads, or a policy
    the plugin's eviction group runs (on a mask's compressed heads or on every head)."""
    from rlkv.inference.vllm import EVICTION_POLICIES

    parsed = parse_method(method)
    return (
        parsed.is_full
        or (parsed.mask is not None and parsed.policy == "streaming")
        or parsed.policy in EVICTION_POLICIES
    )


def engine_plan(engine: str, methods: list[str]) -> str:
    """The line `rlkv eval` prints first: which of `methods` run on which engine, e.g. `engine: vllm for
    full, rlkv; transformers for rkv (no vLLM form yet)` (`engine` "transformers": all of them there)."""
    on_vllm = [m for m in methods if engine == "vllm" and runs_on_vllm(m)]
    rest = [m for m in methods if m not in on_vllm]
    parts = [f"vllm for {', '.join(on_vllm)}"] if on_vllm else []
    if rest:
        parts.append(
            f"transformers for {', '.join(rest)}" + (" (no vLLM form yet)" if engine == "vllm" else "")
        )
    return "engine: " + "; ".join(parts)


@dataclass(frozen=True)
class ReachableKV:
    """A vLLM row's KV tokens as its attention reaches them (the `CacheStats` fields a row reads)."""

    logical_length: int
    kept_tokens: int
    evictions: int
    resident_bytes: None = None
    full_resident_bytes: None = None


def reachable_kv(
    compression: Any, model: Any, num_heads: int, length: int, prompt_length: int = 0
) -> ReachableKV:
    """KV entries the `num_heads` heads of `compression` (a form vLLM serves; None = full) hold for `length`
    cached tokens of which `prompt_length` are the prompt: full heads all of them, compressed heads sink +
    window (the whole prompt + window under `protect_prompt`)."""
    full = None if compression is None else compression.full_heads(model)
    num_full = num_heads if compression is None else (int(full.sum()) if full is not None else 0)
    if compression is None:
        kept_comp = length
    elif compression.policy != "streaming":  # its budget (a ratio: of the real tokens, plus sink + window)
        budget = compression.budget
        if isinstance(budget, float):
            budget = round(budget * length) + compression.sink + compression.window
        kept_comp = min(length, (prompt_length if compression.protect_prompt else 0) + int(budget))
    else:  # a protected prompt is kept whole besides the window, else the sink
        head = max(prompt_length, compression.sink) if compression.protect_prompt else compression.sink
        kept_comp = min(length, head + compression.window)
    kept = num_full * length + (num_heads - num_full) * kept_comp
    return ReachableKV(length, kept, num_heads * length - kept)


class VLLMTaskRunner:
    """Runs eval tasks on `rlkv.inference.vllm_engine.VLLMRunner`, one engine per head split at a time."""

    def __init__(self, cfg: Any, model: Any, max_model_len: int, dtype: str):
        from rlkv.inference.vllm_engine import VLLMRunner

        settings = {"max_model_len": max_model_len} | dict(cfg.vllm_kwargs)
        self.model = model
        self.engines = VLLMRunner(cfg.model, dtype=dtype, seed=cfg.seed, **settings)

    def rows(
        self,
        task: Any,
        compression: Any,
        entries: list[tuple],
        *,
        context: RowContext,
        new_tokens: int,
        ending: StopRule,
        repetition: RepetitionRule | None,
        sampling: dict[str, Any],
        seeds: list[int | None],
    ) -> Iterator[dict[str, Any]]:
        """The rows of `task` for problems `entries` ((id, example, messages, prompt length)), as they finish.

        sampling: temperature and top_p; seeds: one per entry (None when greedy).
        """
        from rlkv.inference import encode_prompts
        from rlkv.inference.vllm import compression_overrides
        from rlkv.inference.vllm_engine import VLLMRequest

        overrides = None if compression is None else compression_overrides(self.model, compression)
        prompts = encode_prompts(context.tokenizer, [e[2] for e in entries])
        requests = [
            VLLMRequest(ids, new_tokens, seed=seed, stop_strings=ending.strings, **sampling)
            for ids, seed in zip(prompts, seeds, strict=True)
        ]
        self.engines.engine(overrides)  # started before the clock: a row is charged its generation only
        stop = _stop_check(ending, repetition, context.tokenizer)
        last = time.perf_counter()
        for result in self.engines.stream(overrides, requests, stop):
            now = time.perf_counter()
            # the last generated token is never attended to, so it is not cached (as in transformers' cache)
            length = len(prompts[result.index]) + len(result.token_ids) - 1
            yield eval_row(
                context,
                task,
                entries[result.index],
                result.token_ids,
                result.finish_reason,
                num_prompt_tokens=len(prompts[result.index]),
                stats=reachable_kv(
                    compression, self.model, context.num_heads, length, len(prompts[result.index])
                ),
                seconds=now - last,
                engine="vllm",
            )
            last = now

    def close(self) -> None:
        """Shut the running engine down."""
        self.engines.close()


def _stop_check(ending: StopRule, repetition: RepetitionRule | None, tokenizer: Any):
    """The per-step check of the transformers engine's `RepetitionStop` and `CodeBlockStop` (stop strings are
    vLLM's own `stop`)."""

    def stop(index: int, token_ids: list[int]) -> str | None:
        n = len(token_ids)
        if repetition is not None and n % REPETITION_CHECK_EVERY == 0 and repetition.is_repetitive(token_ids):
            return "repetition"
        if ending.code_block and "`" in tokenizer.decode(token_ids[-1:]):
            if closes_first_code_block(tokenizer.decode(token_ids)):
                return "stop"
        return None

    return stop if repetition is not None or ending.code_block else None
