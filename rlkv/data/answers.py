"""Moved to `rlkv.verifiers.answers` (issue 77: the verifiers are a room of their own); the old module path
warns with a FutureWarning until rlkv 0.3 (CONTRIBUTING.md, "Other changes")."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib
    import warnings

    moved = importlib.import_module(
        "rlkv.verifiers.answers"
    )  # the module (rlkv.verifiers.answers may name a function)

    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(
        f"rlkv.data.answers.{name} is deprecated and will be removed in rlkv 0.3; use rlkv.verifiers.answers",
        FutureWarning,
        stacklevel=2,
    )
    return getattr(moved, name)
