"""Answer verification, a room of its own: math answers (`answers.py`: the last boxed answer, thinking
stripped; math-verify), code run against its tests in the sandbox (`rlkv.sandbox`), and the registry of
verifiers keyed by a problem's `source` (`verify.py`). `verify(completion, example)` is what rewards, the
curriculum and the eval call; `rlkv.data` re-exports these names."""

from rlkv.verifiers.answers import extract_boxed, strip_thinking
from rlkv.verifiers.verify import (
    CODE_SOURCES,
    MATH_SOURCES,
    check_verifiers,
    extract_code,
    get_verifier,
    register_verifier,
    run_python_tests,
    verify,
    verify_code,
    verify_math,
)

__all__ = [
    "CODE_SOURCES",
    "MATH_SOURCES",
    "check_verifiers",
    "extract_boxed",
    "extract_code",
    "get_verifier",
    "register_verifier",
    "run_python_tests",
    "strip_thinking",
    "verify",
    "verify_code",
    "verify_math",
]
