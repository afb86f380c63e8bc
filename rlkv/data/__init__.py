"""Problem datasets, prompt templates, answer verification and the self-distilled length curriculum."""

from rlkv.data.verify import (
    extract_boxed,
    extract_code,
    get_verifier,
    register_verifier,
    strip_thinking,
    verify,
    verify_code,
    verify_math,
)

__all__ = [
    "extract_boxed",
    "extract_code",
    "get_verifier",
    "register_verifier",
    "strip_thinking",
    "verify",
    "verify_code",
    "verify_math",
]
