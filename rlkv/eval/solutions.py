"""An `rlkv eval` folder's own full-KV solutions as token sequences, to score head masks without generating."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rlkv.eval.config import EvalConfig
from rlkv.eval.results import RESULTS_FILE, read_archive, read_results
from rlkv.eval.runner import benchmark_prompts


def full_kv_solutions(
    cfg: EvalConfig, tokenizer: Any, benchmark: str, num: int | None = None
) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) of the `full` rows (sample 0) of `cfg.out` on `benchmark` that ended before
    the length cap, in the eval's problem order, at most `num`.

    The prompts are the token ids the eval fed the model; the completions are re-encoded from the rows' text
    (special tokens such as the EOS are not in it), or from the folder's archive where the text left
    the row. Raises UserInputError when `benchmark` is not one of the recipe's or the folder holds no
    such row.
    """
    from rlkv.errors import UserInputError
    from rlkv.inference import encode_prompts

    if benchmark not in cfg.benchmarks:
        raise UserInputError(
            f"benchmark {benchmark!r} is not one of the eval recipe's benchmarks {cfg.benchmarks}: pick one"
        )
    completions, archived = {}, read_archive(cfg.out)
    for row in read_results(Path(cfg.out) / RESULTS_FILE):
        if (row["benchmark"], row["method"], row["sample"]) == (benchmark, "full", 0):
            if row["finish_reason"] != "length":
                text = row["completion"] if row["completion"] is not None else archived[row["key"]]
                completions.setdefault(row["problem_id"], text)
    solutions = []
    prompts = benchmark_prompts(dataclasses.replace(cfg, benchmarks=[benchmark]), tokenizer)[benchmark]
    for pid, _, messages, _ in prompts:
        if pid in completions and (num is None or len(solutions) < num):
            completion = tokenizer(completions[pid], add_special_tokens=False)["input_ids"]
            solutions.append((encode_prompts(tokenizer, [messages])[0], completion))
    if not solutions:
        raise UserInputError(
            f"{cfg.out} holds no full-KV row of {benchmark} that ended before the length cap: "
            "run the eval's `full` method first"
        )
    return solutions
