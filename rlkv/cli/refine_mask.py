"""`rlkv refine-mask --mask DIR --model PATH --problems SET --sparsities 0.75,0.875 --out DIR`: refine a head
mask's cut at those sparsities by a swap search on the model's own greedy solutions (rlkv.cut_search.refine_cut)."""

from __future__ import annotations

import argparse

from rlkv.cli import csv_fractions, csv_list, positive_int
from rlkv.cli.ablation_mask import (
    add_solution_args,
    greedy_solutions_of,
    load_for_solutions,
    resumable_scores,
    sink_local,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `refine-mask` subcommand."""
    parser = subparsers.add_parser(
        "refine-mask",
        help="refine a head mask's cut at given sparsities by a swap search on the heads' joint NLL",
        description="Generate the model's greedy solutions of a problem set (full KV), then, from the fewest "
        "compressed heads on, start from the heads MASK keeps full at each sparsity and try swaps of its "
        "lowest-ranked full heads with the highest-ranked compressed ones, keeping a swap when the "
        "teacher-forced NLL of the solutions (the compressed heads at sink + local) falls. Writes a mask "
        "folder whose full heads at each searched sparsity are the set found (nested, so one ranking serves "
        "all), the input's order elsewhere; the search is in its metadata (`cut_search`).",
    )
    parser.add_argument(
        "--mask", required=True, help="the head mask to refine (anything HeadMask.from_pretrained reads)"
    )
    add_solution_args(parser)
    parser.add_argument(
        "--sparsities",
        type=csv_fractions,
        default=[0.75, 0.875],
        help="comma-separated sparsities whose cut to refine (default 0.75,0.875)",
    )
    parser.add_argument(
        "--swaps",
        type=swap_pair,
        default=(3, 4),
        help="IN,OUT: each round tries the IN lowest-ranked full heads against the OUT highest-ranked "
        "compressed ones, IN x OUT NLL passes (default 3,4)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=3, help="swap rounds per sparsity at most (default 3)"
    )
    parser.add_argument("--out", required=True, help="mask folder to write")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def swap_pair(text: str) -> tuple[int, int]:
    """argparse type of --swaps: IN,OUT, two integers >= 1."""
    parts = csv_list(text)
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"{text!r}: give IN,OUT, e.g. 3,4")
    return positive_int(parts[0]), positive_int(parts[1])


def run(args: argparse.Namespace) -> int:
    """Refine the mask and write its folder; prints each sparsity's search. Returns the exit status."""
    import time

    from rlkv._io import check_output_path
    from rlkv.cut_search import refine_cut
    from rlkv.errors import UserInputError
    from rlkv.head_mask import HeadMask

    check_output_path(args.out, what="mask folder (--out)", error=UserInputError)  # before the search
    bad = [s for s in args.sparsities if not 0.0 < s < 1.0]
    if bad:
        raise UserInputError(f"--sparsities {bad}: each must be a fraction of heads in (0, 1)")
    problems, model, tokenizer = load_for_solutions(args)
    mask = HeadMask.from_pretrained(args.mask, model)
    sink, local = sink_local(args)
    began = time.perf_counter()
    sequences = greedy_solutions_of(args, model, tokenizer, problems)
    # every NLL measured is saved as it comes, so a stopped search resumes where it was
    scored, save, partial = resumable_scores(args, model, sequences, sink=sink, local=local)
    refined, searches = refine_cut(
        model,
        sequences,
        mask,
        args.sparsities,
        sink=sink,
        local=local,
        swap_in=args.swaps[0],
        swap_out=args.swaps[1],
        rounds=args.rounds,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        scored=scored,
        on_score=save,
    )
    refined.metadata["cut_search"].update(
        refined_from=args.mask,
        problem_set=args.problems,
        num_problems=len(problems),
        seed=args.seed,
        num_tokens=sum(len(c) for _, c in sequences),
        seconds=round(time.perf_counter() - began, 1),
    )
    refined.save_pretrained(args.out)
    partial.unlink(missing_ok=True)
    print(f"wrote {args.out} (refined from {args.mask}); {refined.metadata['cut_search']['seconds']} s")
    for c in searches:
        print(
            f"cut at s={c.sparsity:g}: NLL increase +{c.start_increase:.4f} -> +{c.increase:.4f} nats/token, "
            f"{len(c.swaps)} swaps, {c.evaluated} layouts scored"
        )
    return 0
