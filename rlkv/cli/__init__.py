"""The `rlkv` command line: one subcommand per module listed in SUBCOMMANDS.

Each subcommand module defines `register(subparsers)` which adds its parser and sets
`func=` to a callable taking the parsed args; heavy imports happen inside that callable.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "rlkv.cli.generate",
    "rlkv.cli.data",
    "rlkv.cli.export_mask",
    "rlkv.cli.steering",
    "rlkv.cli.eval",
]


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = argparse.ArgumentParser(
        prog="rlkv", description="RL-learned head masks and compressed KV caches"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rlkv` console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
