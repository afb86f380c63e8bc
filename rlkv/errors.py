"""Errors the command-line entry points report as one `error:` line with exit status 2.

`is_user_error(e)` is True for the project's own error types (bad head masks, compression
configs, policies, problem data, curricula, eval methods, steering files, models without
per-KV-head attention, an unavailable code sandbox) and for `UserInputError`; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import NoReturn


class UserInputError(ValueError):
    """Invalid input from the user (a path, a flag value, an output location), found before any work."""


def user_error_types() -> tuple[type[Exception], ...]:
    """The exception types whose message alone tells the user what to fix."""
    from rlkv.data.curriculum import CurriculumError
    from rlkv.data.loaders import ProblemDataError
    from rlkv.data.sandbox import SandboxError
    from rlkv.eval.methods import MethodError
    from rlkv.gates import UnsupportedModelError
    from rlkv.head_mask import HeadMaskError
    from rlkv.inference.config import CompressionConfigError
    from rlkv.policies import UnknownPolicyError
    from rlkv.policies.steering import SteeringError

    return (
        UserInputError,
        CurriculumError,
        ProblemDataError,
        SandboxError,
        MethodError,
        UnsupportedModelError,
        HeadMaskError,
        CompressionConfigError,
        UnknownPolicyError,
        SteeringError,
    )


def is_user_error(error: BaseException) -> bool:
    """True when `error` is one of `user_error_types()` (report its message, not a traceback)."""
    return isinstance(error, user_error_types())


def run_reporting_user_errors(prog: str, fn: Callable[[], int | None]) -> int:
    """`fn()`'s exit status (None is 0); a user error from it prints `PROG: error: MESSAGE` and gives 2.

    Any other exception propagates with its traceback.
    """
    try:
        return int(fn() or 0)
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


class OneLineErrors:
    """argparse mixin: a usage error is one `PROG: error: ...` line (exit status 2), without the usage text."""

    def error(self, message: str) -> NoReturn:
        """Print one error line pointing to --help and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
