"""One results.jsonl row of `rlkv eval`: a generation scored, its error mode and its KV memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlkv.eval.error_modes import RepetitionRule, classify_error
from rlkv.eval.results import row_key


@dataclass(frozen=True)
class RowContext:
    """What every row of a run shares: the tokenizer, the repetition rule, the model's KV heads (L x H_kv),
    the bytes of one token's K and V in one head and the dtype both engines run ("float32", "bfloat16")."""

    tokenizer: Any
    repetition: RepetitionRule
    num_heads: int
    bytes_per_entry: int
    dtype: str


def eval_row(
    context: RowContext,
    task: Any,
    entry: tuple,
    token_ids: list[int],
    finish: str,
    *,
    num_prompt_tokens: int,
    stats: Any,
    seconds: float,
    engine: str,
) -> dict[str, Any]:
    """The row of `task` (benchmark, method, sparsity, sample) on problem `entry` (id, example, messages, length).

    stats: the generation's `CacheStats` (None: no compressed cache, or an engine that reports none);
    seconds: the wall time the row is charged (a cell's rows sum to its generation time).
    """
    from rlkv.verifiers import verify
    from rlkv.verifiers.verify import extract_boxed, strip_thinking

    pid, example = entry[0], entry[1]
    text = context.tokenizer.decode(token_ids, skip_special_tokens=True)
    correct = bool(verify(text, dict(example)))
    kept = stats.kept_tokens if stats else 0
    return {
        "key": row_key(task.benchmark, pid, task.method, task.sparsity, task.sample),
        "benchmark": task.benchmark,
        "problem_id": pid,
        "method": task.method,
        "sparsity": task.sparsity,
        "sample": task.sample,
        "answer": example["answer"],
        "prediction": extract_boxed(strip_thinking(text)),
        "correct": correct,
        "completion": text,
        "num_prompt_tokens": num_prompt_tokens,
        "num_generated_tokens": len(token_ids),
        "finish_reason": finish,
        "error_mode": classify_error(
            correct=correct, finish_reason=finish, token_ids=token_ids, rule=context.repetition
        ),
        "logical_length": stats and stats.logical_length,
        "kv_tokens": stats and stats.kept_tokens,
        "kv_tokens_per_head": kept / context.num_heads,
        "kv_bytes": kept * context.bytes_per_entry,
        "resident_bytes": stats and stats.resident_bytes,
        "full_resident_bytes": stats and stats.full_resident_bytes,
        "evictions": stats and stats.evictions,
        "seconds": round(seconds, 4),
        "engine": engine,
        "dtype": context.dtype,
    }
