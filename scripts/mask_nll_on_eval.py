"""Screen head masks on an `rlkv eval` folder's own full-KV solutions (no generation).

Reads the eval recipe (model, problem set, split, exclusions, template: the prompts the eval ran), takes the
first `--num` rows of method `full` on `--benchmark` that did not hit the length cap, in problem order, and
prints each mask's teacher-forced NLL increase over full KV at each sparsity (`rlkv.ablation.mask_nll`: the
heads a mask compresses at s run sink + local, the rest full). The numbers of
`data/eval/qwen2.5-coder-0.5b-instruct/mask_nll.md` come from:

    .venv/bin/python scripts/mask_nll_on_eval.py --config recipes/eval/qwen2.5-coder-0.5b-instruct.yaml \\
        --num 24 --sparsities 0.5,0.75,0.875 data/masks/qwen2.5-coder-0.5b-instruct-ablation \\
        data/training/qwen2.5-coder-0.5b-instruct-continued/checkpoint-70

`rlkv mask-nll` does the same on freshly generated greedy solutions of any problem set.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from rlkv.ablation import mask_nll
from rlkv.cli import csv_fractions
from rlkv.cli.mask_nll import named_masks, nll_table
from rlkv.eval.config import EvalConfig
from rlkv.eval.results import RESULTS_FILE, read_results
from rlkv.eval.runner import benchmark_prompts
from rlkv.inference import load


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--config", required=True, help="the eval recipe (YAML) whose out folder holds the rows"
    )
    parser.add_argument(
        "--benchmark", default="reasoning_gym:gsm_symbolic", help="one of the recipe's benchmarks"
    )
    parser.add_argument("--num", type=int, default=24, help="full-KV solutions to score (default 24)")
    parser.add_argument("--sparsities", type=csv_fractions, default=[0.5, 0.75])
    parser.add_argument("--random", type=int, default=0, help="also N random masks (random-mask@0..N-1)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument(
        "masks", nargs="*", help="head masks (HeadMask.from_pretrained forms), each optionally NAME=PATH"
    )
    args = parser.parse_args(argv)

    cfg = EvalConfig.from_yaml(args.config)
    if args.benchmark not in cfg.benchmarks:
        parser.error(f"--benchmark {args.benchmark!r} is not one of the recipe's benchmarks {cfg.benchmarks}")
    cfg = dataclasses.replace(cfg, benchmarks=[args.benchmark])  # only its prompts
    model, tokenizer = load(cfg.model, dtype=cfg.dtype)
    full = {
        r["problem_id"]: r
        for r in read_results(Path(cfg.out) / RESULTS_FILE)
        if r["benchmark"] == args.benchmark and r["method"] == "full" and r["finish_reason"] != "length"
    }
    sequences = []
    for pid, _, messages, _ in benchmark_prompts(cfg, tokenizer)[args.benchmark]:
        if pid in full and len(sequences) < args.num:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            sequences.append(
                (prompt, tokenizer(full[pid]["completion"], add_special_tokens=False)["input_ids"])
            )
    if not sequences:
        parser.error(
            f"{cfg.out} has no full-KV rows of {args.benchmark} below the cap: run the eval's full first"
        )
    masks = named_masks(args.masks, args.random, model)
    base, increases = mask_nll(
        model, sequences, masks, args.sparsities, sink=cfg.sink, local=cfg.window, batch_size=args.batch_size
    )
    print(nll_table(base, increases, args.sparsities, len(sequences), sum(len(c) for _, c in sequences)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
