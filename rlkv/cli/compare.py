"""`rlkv compare A B`: paired pass@1 difference of two eval cells (FOLDER:METHOD[@SPARSITY]), per benchmark."""

from __future__ import annotations

import argparse
import json

from rlkv.cli import positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `compare` subcommand."""
    parser = subparsers.add_parser(
        "compare",
        help="paired pass@1 difference of two eval cells (FOLDER:METHOD[@SPARSITY]) with bootstrap intervals",
        description="Pair the rows of two `rlkv eval` cells by (benchmark, problem id), e.g. a new mask's run "
        "against the committed grid: `rlkv compare results/eval/new:rlkv@0.75 results/eval/grid:ablation-mask@0.75`. "
        "Prints per benchmark (and over all) n, solved counts, pass@1 and a - b with its 95% paired-bootstrap "
        "interval; warns when the folders' rows came from different host types.",
    )
    parser.add_argument("a", help="FOLDER:METHOD[@SPARSITY]")
    parser.add_argument("b", help="FOLDER:METHOD[@SPARSITY]")
    parser.add_argument("--resamples", type=positive_int, default=10_000, help="bootstrap resamples (10,000)")
    parser.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    from rlkv.eval.compare import compare_cells, format_comparison, parse_cell

    a, b = parse_cell(args.a), parse_cell(args.b)
    table = compare_cells(a, b, resamples=args.resamples, seed=args.seed)
    print(json.dumps(table, indent=2) if args.json else format_comparison(a, b, table))
    return 0
