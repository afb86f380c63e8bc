"""The `rlkv` command line: one subcommand per module listed in SUBCOMMANDS.

Each subcommand module defines `register(subparsers)` which adds its parser and sets
`func=` to a callable taking the parsed args; heavy imports happen inside that callable.
User errors (`rlkv.errors.is_user_error`, and bad arguments) end as one `PROG: error: ...`
line with exit status 2; anything else keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from rlkv.errors import OneLineErrors, run_reporting_user_errors
from rlkv.vllm_plugin.lifetime import exit_with_parent_env

SUBCOMMANDS = [
    "rlkv.cli.generate",
    "rlkv.cli.data",
    "rlkv.cli.export_mask",
    "rlkv.cli.ablation_mask",
    "rlkv.cli.mask_nll",
    "rlkv.cli.refine_mask",
    "rlkv.cli.search_mask",
    "rlkv.cli.steering",
    "rlkv.cli.eval",
    "rlkv.cli.compare",
    "rlkv.cli.train",
    "rlkv.cli.bench",
    "rlkv.cli.serve",
]


class OneLineErrorParser(OneLineErrors, argparse.ArgumentParser):
    """The `rlkv` parser: usage errors are one line (see `rlkv.errors.OneLineErrors`)."""


def csv_list(text: str) -> list[str]:
    """argparse type: comma-separated names, blanks dropped."""
    return [t.strip() for t in text.split(",") if t.strip()]


def vllm_arg(text: str) -> tuple[str, object]:
    """argparse type of --vllm-arg: `KEY=VALUE`, one `vllm.LLM` argument (dashes in KEY as underscores; VALUE
    read as JSON where it parses, e.g. 0.5, true, {"level": 0}, else kept as text)."""
    import json

    key, eq, value = text.partition("=")
    key = key.strip().removeprefix("--").replace("-", "_")
    if not eq or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"--vllm-arg {text!r}: give KEY=VALUE, e.g. --vllm-arg kv_cache_memory_bytes=4000000000"
        )
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def add_vllm_arg(parser: argparse.ArgumentParser) -> None:
    """The repeatable `--vllm-arg KEY=VALUE` flag (into `args.vllm_args`, a list of pairs)."""
    parser.add_argument(
        "--vllm-arg",
        dest="vllm_args",
        type=vllm_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --engine vllm: one vllm.LLM argument (repeatable), e.g. gpu_memory_utilization=0.5, "
        "kv_cache_memory_bytes=4000000000, enforce_eager=true; on CPU rlkv sizes the KV cache from free "
        "memory unless one of those two is set",
    )


def csv_fractions(text: str) -> list[float]:
    """argparse type: comma-separated numbers (fractions such as sparsities)."""
    try:
        return [float(t) for t in csv_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated fractions, e.g. 0.2,0.4,0.6,0.8"
        ) from None


def budget_value(text: str) -> int | float:
    """argparse type of --budget: an int (tokens per head) or a float ratio (e.g. 0.25)."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--budget {text!r}: give tokens (e.g. 2048) or a ratio (e.g. 0.25)"
            ) from None


def json_object(text: str) -> dict:
    """argparse type of --policy-kwargs: a JSON object (the policy's constructor arguments)."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"--policy-kwargs {text!r} is not valid JSON ({e.msg}); give an object such as '{{\"lam\": 0.1}}'"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"--policy-kwargs must be a JSON object, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every registered subcommand."""
    parser = OneLineErrorParser(prog="rlkv", description="RL-learned head masks and compressed KV caches")
    parser.add_argument(
        "--code-sandbox",
        metavar="LEVEL",
        default=None,
        help="containment of model-generated code in verification (sets RLKV_CODE_SANDBOX): auto (default: "
        "OS sandbox where available), guard, or namespace (require the OS sandbox)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `rlkv` console script."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "passes_extra_args", False):
        args.extra_args = extra  # `rlkv train`: the recipe parser reads them; `rlkv bench`: benchmarks'
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    prog = " ".join(["rlkv", args.command, *(v for k, v in vars(args).items() if k.endswith("_command"))])

    def run() -> int | None:
        # any vLLM engine this command starts (serve, eval, curriculum) dies with it, kill -9 included
        os.environ.update(exit_with_parent_env())
        if args.code_sandbox:
            from rlkv.sandbox import CONTAINMENT_ENV, active_containment

            os.environ[CONTAINMENT_ENV] = args.code_sandbox
            active_containment()  # a required sandbox that is missing fails here, before any work
        return args.func(args)

    return run_reporting_user_errors(prog, run)


if __name__ == "__main__":
    sys.exit(main())
