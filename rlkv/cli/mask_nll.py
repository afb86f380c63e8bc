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
        help="with --solutions-from: which of its benchmarks (default: the first); --pass-at-1 cells are then "
        "scored on that benchmark's rows only",
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
    parser.add_argument(
        "--decisive",
        type=float,
        default=None,
        metavar="NATS",
        help="also screen the decisive tokens: those whose NLL rises by more than NATS with every head "
        "compressed (one set per solution, fixed before any mask is scored); e.g. 1.0",
    )
    parser.add_argument(
        "--pass-at-1",
        dest="pass_at_1",
        action="append",
        default=[],
        metavar="NAME@S=FOLDER:METHOD@S",
        help="the pass@1 of mask NAME at sparsity S: an `rlkv eval` cell (repeatable); with 3 or more, the "
        "rank correlation of each screen with pass@1 over them is printed",
    )
    parser.add_argument("--out", default=None, help="also write the table as JSON here (atomically)")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run, generation_defaults={k: parser.get_default(k) for k in _GENERATION_ONLY})


def run(args: argparse.Namespace) -> int:
    """Score every mask at every sparsity and print the table. Returns the exit status."""
    from rlkv._io import atomic_write_text, check_output_path
    from rlkv.ablation import screen_masks
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
    outcomes = pass_at_1_cells(args.pass_at_1, masks, args.benchmark)  # checked before scoring
    screen = screen_masks(
        model,
        sequences,
        masks,
        args.sparsities,
        decisive=args.decisive,
        sink=sink,
        local=local,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )
    base, increases = screen.base_nll, screen.increase
    tokens = sum(len(c) for _, c in sequences)
    print(nll_table(base, increases, args.sparsities, len(sequences), tokens))
    if screen.decisive_increase is not None:
        print(
            f"decisive tokens (NLL rise > {screen.threshold:g} nats with every head compressed): "
            f"{screen.num_decisive} of {screen.num_tokens}; their mean increases:"
        )
        print(
            nll_table(base, screen.decisive_increase, args.sparsities, len(sequences), tokens).split("\n", 1)[
                1
            ]
        )
    correlations = proxy_correlations(screen, outcomes)
    for name, (rho, n) in correlations.items():
        print(f"rank correlation with pass@1 over {n} (mask, sparsity) pairs: {name} screen {rho:+.2f}")
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
        if screen.decisive_increase is not None:
            doc["decisive"] = {
                "threshold": screen.threshold,
                "num_tokens": screen.num_decisive,
                "increase": {
                    n: {str(s): v for s, v in row.items()} for n, row in screen.decisive_increase.items()
                },
            }
        if outcomes:
            doc["pass_at_1"] = {f"{name}@{s:g}": p for (name, s), p in outcomes.items()}
            doc["rank_correlation"] = {name: {"rho": rho, "n": n} for name, (rho, n) in correlations.items()}
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


def pass_at_1_cells(
    specs: list[str], masks: dict[str, Any], benchmark: str | None = None
) -> dict[tuple[str, float], float]:
    """{(mask name, sparsity): pass@1 over the cell's problems (of `benchmark` only, when given: the screened
    solutions' own)} of `--pass-at-1 NAME@S=FOLDER:METHOD@S` specs (each NAME one of `masks`); a bad spec or a
    cell without rows of `benchmark` is one clear error."""
    from statistics import mean

    from rlkv.errors import UserInputError
    from rlkv.eval.compare import cell_outcomes, parse_cell

    outcomes = {}
    for spec in specs:
        target, eq, cell = spec.partition("=")
        name, at, sparsity = target.rpartition("@")
        try:
            s = float(sparsity)
        except ValueError:
            s = None
        if not eq or not at or s is None or name not in masks:
            raise UserInputError(
                f"--pass-at-1 {spec!r}: write NAME@S=FOLDER:METHOD@S with NAME one of {sorted(masks)} and S a "
                "sparsity, e.g. ablation@0.75=results/eval/grid:ablation-mask@0.75"
            )
        solved = [
            v for (bench, _), v in cell_outcomes(parse_cell(cell)).items() if benchmark in (None, bench)
        ]
        if not solved:
            raise UserInputError(f"--pass-at-1 {spec!r}: the cell has no rows of {benchmark}")
        outcomes[(name, s)] = mean(solved)
    return outcomes


def proxy_correlations(screen: Any, outcomes: dict[tuple[str, float], float]) -> dict[str, tuple[float, int]]:
    """{screen name: (Spearman rho of its NLL increase with pass@1, pairs)} over the (mask, sparsity) pairs of
    `outcomes` that the screen scored; empty under 3 pairs. A useful screen has rho well below 0 (a larger
    increase, a lower pass@1)."""
    from rlkv.eval.tables import rank_correlation

    screens = {"token-mean": screen.increase}
    if screen.decisive_increase is not None:
        screens["decisive-token"] = screen.decisive_increase
    pairs = [(name, s) for name, s in outcomes if s in screen.increase.get(name, {})]
    if len(pairs) < 3:
        return {}
    passed = [outcomes[p] for p in pairs]
    return {
        label: (rank_correlation([values[n][s] for n, s in pairs], passed), len(pairs))
        for label, values in screens.items()
    }
