"""Deprecated names that keep working until they are removed (CONTRIBUTING.md, "Other changes").

A module whose names moved sets its PEP 562 `__getattr__` to one of these: the old name still gives the
object, with a `FutureWarning` naming the replacement and the release that removes it.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

REMOVED_IN = "0.3"


def _warn(old: str, replacement: str) -> None:
    warnings.warn(
        f"{old} is deprecated and will be removed in rlkv {REMOVED_IN}; use {replacement}",
        FutureWarning,
        stacklevel=3,
    )


def moved_names(module: str, names: dict[str, tuple[Callable[[], Any], str]]) -> Callable[[str], Any]:
    """A module `__getattr__` for `module`'s renamed names: `names[old] = (the object's getter, what to use)`."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        get, replacement = names[name]
        _warn(f"{module}.{name}", replacement)
        return get()

    return __getattr__


def moved_module(module: str, new: str) -> Callable[[str], Any]:
    """A module `__getattr__` for `module`, whose names all moved to the module `new`."""

    def __getattr__(name: str) -> Any:
        target = importlib.import_module(new)  # the module itself (a package attribute may name a function)
        if name.startswith("__") or not hasattr(target, name):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        _warn(f"{module}.{name}", f"{new}.{name}")
        return getattr(target, name)

    return __getattr__
