"""`rlkv mask-nll --model PATH --problems SET --masks A,B --random 3 --sparsities 0.5,0.75`: compare head masks
by the NLL increase of the model's own greedy solutions when each mask's compressed heads run sink + local.
`--solutions-from EVAL_RECIPE` scores an `rlkv eval` folder's full-KV solutions instead of generating."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rlkv.cli import csv_fractions, csv_list
from rlkv.cli.ablation_mask import add_solution_args, greedy_solutions_of, load_for_solutions, sink_local

# flags that only shape generated solutions: meaningless with --solutions-from (the eval recipe set them)
_GENERATION_ONLY = (
    "model",
    "problems",
    "split",
    "seed",
    "exclude_problems",
    "max_new_tokens",
    "template",
    "dtype",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `mask-nll` subcommand."""
    parser = subparsers.add_parser(
        "mask-nll",
        help="compare head masks at given sparsities by the NLL increase of greedy solutions (no generation)",
        description="Generate the model's greedy solutions of a problem set (full KV), then for every mask and "
        "sparsity s run the heads the mask compresses at s with sink + local attention (RLKV gates 0, the rest "
        "1) and print the teacher-forced NLL increase (nats/token) over full KV: the smaller, the more of the "
        "solutions the mask keeps. A cheap screen of masks (learned checkpoints, ablation, random) before "
        "an `rlkv eval` run. With --solutions-from, the solutions are an eval folder's own full-KV rows (no "
        "generation; model, prompts, dtype, sink and window from the eval recipe; --dtype, --sink and --local "
        "override the last three).",
    )
    add_solution_args(parser, required=False)
    parser.add_argument(
        "--solutions-from",
        dest="solutions_from",
        default=None,
        metavar="EVAL_RECIPE",
        help="score the full-KV rows of this eval recipe's out folder (the first --num that ended before the "
        "cap, in problem order) instead of generating; replaces --model / --problems",
    )
    parser.add_argument(
        "--benchmark",
        default=None,
        help="with --solutions-from: which of its benchmarks (default: the first)",
    )
    parser.add_argument(
        "--masks",
        type=csv_list,
        default=[],
        help="comma-separated head masks (HeadMask.from_pretrained forms), each optionally NAME=PATH",
    )
    parser.add_argument(
        "--random", type=int, default=0, help="also N random masks (the eval's random-mask@0..N-1 draws)"
    )
    parser.add_argument(
        "--sparsities",
        type=csv_fractions,
        required=True,
        help="comma-separated fractions of KV heads compressed",
    )
    parser.add_argument("--out", default=None, help="also write the table as JSON here (atomically)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run, generation_defaults={k: parser.get_default(k) for k in _GENERATION_ONLY})


def run(args: argparse.Namespace) -> int:
    """Score every mask at every sparsity and print the table. Returns the exit status."""
    from rlkv._io import atomic_write_text, check_output_path
    from rlkv.ablation import mask_nll
    from rlkv.errors import UserInputError

    if not args.masks and args.random < 1:
        raise UserInputError("mask-nll: give --masks and/or --random N (N >= 1)")
    bad = [s for s in args.sparsities if not 0.0 <= s <= 1.0]
    if bad:
        raise UserInputError(f"--sparsities {bad}: each must be a fraction of heads in [0, 1]")
    if args.out:  # before generating and scoring, not after
        check_output_path(args.out, what="table (--out)", folder=False, error=UserInputError)
    if args.solutions_from:
        model, sequences, (sink, local) = _eval_solutions(args)
        source, num_problems = f"{args.solutions_from}:{args.benchmark}", len(sequences)
    elif not (args.model and args.problems):
        raise UserInputError(
            "mask-nll: give --model and --problems (greedy solutions generated here), "
            "or --solutions-from EVAL_RECIPE (an eval folder's full-KV solutions)"
        )
    else:
        problems, model, tokenizer = load_for_solutions(args)
        sink, local = sink_local(args)
        sequences = greedy_solutions_of(args, model, tokenizer, problems)
        source, num_problems = args.problems, len(problems)
    masks = named_masks(args.masks, args.random, model)
    base, increases = mask_nll(
        model,
        sequences,
        masks,
        args.sparsities,
        sink=sink,
        local=local,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    tokens = sum(len(c) for _, c in sequences)
    print(nll_table(base, increases, args.sparsities, len(sequences), tokens))
    if args.out:
        doc = {
            "base_nll": base,
            "num_sequences": len(sequences),
            "num_tokens": tokens,
            "sink": sink,
            "local": local,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "problems": source,
            "num_problems": num_problems,
            "increase": {name: {str(s): v for s, v in row.items()} for name, row in increases.items()},
        }
        atomic_write_text(args.out, json.dumps(doc, indent=1) + "\n")
    return 0


def _eval_solutions(
    args: argparse.Namespace,
) -> tuple[Any, list[tuple[list[int], list[int]]], tuple[int, int]]:
    """(model, solutions, (sink, local)) for --solutions-from; sink / local not given are the recipe's."""
    from rlkv.errors import UserInputError
    from rlkv.eval.config import EvalConfig
    from rlkv.eval.solutions import full_kv_solutions
    from rlkv.inference import load

    # --dtype may override the recipe's: a screen on a CPU without bf16 runs every mask in float32
    given = [
        k for k, default in args.generation_defaults.items() if k != "dtype" and getattr(args, k) != default
    ]
    if given:
        flags = ", ".join("--" + k.replace("_", "-") for k in given)
        raise UserInputError(
            f"{flags}: not used with --solutions-from (the eval recipe sets them); drop them"
        )
    cfg = EvalConfig.from_yaml(args.solutions_from)
    args.benchmark = args.benchmark or cfg.benchmarks[0]
    dtype = cfg.dtype if args.dtype == args.generation_defaults["dtype"] else args.dtype
    model, tokenizer = load(cfg.model, dtype=dtype, device=args.device)
    return (
        model,
        full_kv_solutions(cfg, tokenizer, args.benchmark, args.num),
        sink_local(args, (cfg.sink, cfg.window)),
    )


def named_masks(specs: list[str], num_random: int, model: Any) -> dict[str, Any]:
    """{name: HeadMask} of `NAME=PATH` / `PATH` specs (HeadMask.from_pretrained forms, checked against
    `model`) plus `num_random` random masks named as the eval's random-mask@k draws."""
    from rlkv.head_mask import HeadMask

    masks = {}
    for spec in specs:
        name, _, path = spec.rpartition("=")
        masks[name or path] = HeadMask.from_pretrained(path, model)
    for k in range(num_random):
        masks[f"random-mask@{k}"] = HeadMask.random(model, seed=k)
    return masks


def nll_table(
    base: float, increases: dict[str, dict[float, float]], sparsities: list[float], num: int, tokens: int
) -> str:
    """The printed table: full KV's NLL, then one row of increases (nats/token) per mask."""
    width = max(len(n) for n in increases)
    lines = [
        f"full KV: {base:.4f} nats/token over {num} solutions ({tokens} tokens); increases:",
        " " * width + "".join(f"  s={s:<7g}" for s in sparsities),
    ]
    lines += [
        name.ljust(width) + "".join(f"  +{row[s]:<8.4f}" for s in sparsities)
        for name, row in increases.items()
    ]
    return "\n".join(lines)
