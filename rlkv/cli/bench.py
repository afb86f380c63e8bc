"""`rlkv bench --suite ...`: the benchmarks of a checkout (`python -m benchmarks`, see docs/guides/benchmarks.md).

`benchmarks/` lives beside `rlkv/` in the repository and is not installed with the package, so this
runs `python -m benchmarks` from the checkout that holds this `rlkv`, with every argument unchanged,
and fails with one line where there is none (a pip install without the repository).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlkv.errors import UserInputError


def checkout_root() -> Path:
    """The repository folder that holds this `rlkv` package (for an editable install or a checkout)."""
    return Path(__file__).resolve().parents[2]


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks of this checkout: --suite all|decode,memory,...|serve|gpu|... (python -m benchmarks)",
        description="Run `python -m benchmarks` of the repository checkout with these arguments; "
        "`rlkv bench --help` lists its suites and options.",
        add_help=False,
    )
    parser.set_defaults(func=run, passes_extra_args=True)


def run(args) -> int:
    root = checkout_root()
    if not ((root / "benchmarks" / "__main__.py").is_file() and (root / "pyproject.toml").is_file()):
        raise UserInputError(
            f"no benchmarks/ beside the installed rlkv ({root}): the benchmarks live in the repository; "
            "clone it and run `pip install -e .` there, then `rlkv bench` or `python -m benchmarks`"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.call([sys.executable, "-m", "benchmarks", *(args.extra_args or ["--help"])], env=env)
