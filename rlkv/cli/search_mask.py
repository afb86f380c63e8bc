"""`rlkv search-mask --mask DIR --model PATH --problems SET --start 0.5 --stop 0.875 --out DIR`: the "search (no
RL)" baseline, a block-greedy backward elimination on the model's own greedy solutions (rlkv.cut_search.eliminate)."""

from __future__ import annotations

import argparse

from rlkv.cli import positive_int
from rlkv.cli.ablation_mask import (
    add_solution_args,
    greedy_solutions_of,
    load_for_solutions,
    resumable_scores,
    sink_local,
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `search-mask` subcommand."""
    parser = subparsers.add_parser(
        "search-mask",
        help="rank heads by a backward elimination on the heads' joint NLL (the search baseline, no RL)",
        description="Generate the model's greedy solutions of a problem set (full KV), then start from the "
        "heads MASK keeps full at --start (a near-lossless set, e.g. the ablation mask's s=0.5 heads) and, "
        "round by round, score compressing each remaining full head (with --shards k: each layer's next k "
        "heads) together with those already compressed, by the teacher-forced NLL of the solutions, and "
        "compress the --block cheapest, down to the heads kept at --stop. Writes a mask folder whose ranking "
        "is the removal order (nested: one ranking for every sparsity from --start to --stop); the rounds "
        "are in its metadata (`elimination`). A stopped search resumes from OUT.partial.json.",
    )
    parser.add_argument(
        "--mask",
        required=True,
        help="the mask whose --start set the search starts from (HeadMask.from_pretrained)",
    )
    add_solution_args(parser)
    parser.add_argument("--start", type=float, default=0.5, help="sparsity of the start set (default 0.5)")
    parser.add_argument(
        "--stop", type=float, default=0.875, help="sparsity the search stops at (default 0.875)"
    )
    parser.add_argument(
        "--block",
        type=positive_int,
        default=2,
        help="heads (or shard groups) compressed per round (default 2)",
    )
    parser.add_argument(
        "--shards",
        type=positive_int,
        default=1,
        help="tensor-parallel ranks the sets must balance over: every layer keeps a multiple of this many "
        "full heads (default 1)",
    )
    parser.add_argument("--out", required=True, help="mask folder to write")
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run the elimination and write the mask folder; prints each round. Returns the exit status."""
    import time

    from rlkv._io import check_output_path
    from rlkv.cut_search import eliminate
    from rlkv.errors import UserInputError
    from rlkv.head_mask import HeadMask

    check_output_path(args.out, what="mask folder (--out)", error=UserInputError)  # before the search
    if not 0.0 <= args.start < args.stop < 1.0:
        raise UserInputError(
            f"--start {args.start} --stop {args.stop}: give sparsities with 0 <= start < stop < 1 (e.g. 0.5, 0.875)"
        )
    problems, model, tokenizer = load_for_solutions(args)
    mask = HeadMask.from_pretrained(args.mask, model)
    if mask.num_kv_heads % args.shards:
        raise UserInputError(f"--shards {args.shards}: must divide the model's {mask.num_kv_heads} KV heads")
    sink, local = sink_local(args)
    began = time.perf_counter()
    sequences = greedy_solutions_of(args, model, tokenizer, problems)
    settings = dict(
        sink=sink, local=local, start=args.start, stop=args.stop, block=args.block, shards=args.shards
    )
    scored, save, partial = resumable_scores(args, model, sequences, **settings)
    searched, rounds = eliminate(
        model,
        sequences,
        mask,
        **settings,
        batch_size=args.batch_size,
        progress=not args.no_progress,
        scored=scored,
        on_score=save,
    )
    searched.metadata["elimination"].update(
        searched_from=args.mask,
        problem_set=args.problems,
        num_problems=len(problems),
        seed=args.seed,
        num_tokens=sum(len(c) for _, c in sequences),
        layouts_scored=len(scored),
        seconds=round(time.perf_counter() - began, 1),
    )
    searched.save_pretrained(args.out)
    partial.unlink(missing_ok=True)
    meta = searched.metadata["elimination"]
    print(
        f"wrote {args.out} (searched from {args.mask}); {meta['layouts_scored']} layouts, {meta['seconds']} s"
    )
    for n, r in enumerate(rounds, 1):
        print(
            f"round {n}: compressed {r.removed}, {len(r.full)} full heads left, NLL increase "
            f"+{r.increase:.4f} nats/token ({r.evaluated} layouts scored)"
        )
    return 0
