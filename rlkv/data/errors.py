"""The data room's user-facing error (reported by the CLI as one `error:` line)."""

from rlkv.errors import UserError


class ProblemDataError(ValueError, UserError):
    """A problem file or dataset is unusable (missing field, bad line, empty)."""
