"""Errors the command-line entry points report as one `error:` line with exit status 2.

`is_user_error(e)` is True for the project's own error types (bad head masks, compression
configs, policies, problem data, curricula, eval methods, steering files, models without
per-KV-head attention, an unavailable code sandbox) and for `UserInputError`; anything else
is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable
from typing import NoReturn


class UserError(Exception):
    """Marker base of the project's error types whose message alone tells the user what to fix.

    Each room's error type (HeadMaskError, CompressionConfigError, ProblemDataError, ...) also
    derives from its builtin kind (ValueError, RuntimeError), so callers can catch either.
    """


class UserInputError(ValueError, UserError):
    """Invalid input from the user (a path, a flag value, an output location), found before any work."""


class ProblemDataError(ValueError, UserError):
    """A problem file or dataset is unusable (missing field, bad line, empty): raised by the loaders
    (`rlkv.data`) and the verifiers (`rlkv.verifiers`, a malformed `metadata` field)."""


def is_user_error(error: BaseException) -> bool:
    """True for the project's own error types (`UserError`): report the message, not a traceback."""
    return isinstance(error, UserError)


def run_reporting_user_errors(prog: str, fn: Callable[[], int | None]) -> int:
    """`fn()`'s exit status (None is 0); a user error from it prints `PROG: error: MESSAGE` and gives 2.

    Any other exception propagates with its traceback.
    """
    try:
        return int(fn() or 0)
    except Exception as e:
        if isinstance(e, OSError) and e.errno in _NO_SPACE:
            where = f" writing {e.filename}" if e.filename else ""
            print(
                f"{prog}: error: no space left on the device{where}: free some space and run the same "
                "command again (what was written before is kept; a resumable job continues)",
                file=sys.stderr,
            )
            return 2
        if not is_user_error(e):
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2


_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class OneLineErrors:
    """argparse mixin: a usage error is one `PROG: error: ...` line (exit status 2), without the usage text."""

    def error(self, message: str) -> NoReturn:
        """Print one error line pointing to --help and exit with status 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")
