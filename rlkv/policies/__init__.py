"""Token-eviction policies for the compressed heads of a `HeadMixedCache`, by name.

`get_policy(name, **kwargs)` builds one, `available()` lists the names, `@register_policy(name)`
adds a class. The interface a policy implements is documented in `rlkv/policies/base.py`.
Built-in policies live in one module each under `rlkv/policies/` and register on import.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable

from rlkv.errors import UserError
from rlkv.policies.base import CompressionPolicy, keep_forced_only, keep_top_scores

_REGISTRY: dict[str, type[CompressionPolicy]] = {}
_BUILTINS_LOADED = False


class UnknownPolicyError(ValueError, UserError):
    """A policy name that no registered policy has."""


def register_policy(name: str) -> Callable[[type[CompressionPolicy]], type[CompressionPolicy]]:
    """Class decorator: make `cls` available as `get_policy(name)`."""

    def decorator(cls: type[CompressionPolicy]) -> type[CompressionPolicy]:
        if not (isinstance(cls, type) and issubclass(cls, CompressionPolicy)):
            raise TypeError(f"@register_policy({name!r}) must decorate a CompressionPolicy subclass")
        existing = _REGISTRY.get(name)
        if existing is not None and existing.__qualname__ != cls.__qualname__:
            raise ValueError(
                f"policy name {name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
            )
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorator


def _load_builtins() -> None:
    """Import every module of this package once, so their @register_policy decorators run."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base", "helpers"):
            importlib.import_module(f"{__name__}.{info.name}")


def available() -> list[str]:
    """Sorted names of all registered policies."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_policy_class(name: str) -> type[CompressionPolicy]:
    """The class registered under `name`; `UnknownPolicyError` lists the available names."""
    _load_builtins()
    if name not in _REGISTRY:
        raise UnknownPolicyError(f"unknown policy {name!r}; available policies: {', '.join(available())}")
    return _REGISTRY[name]


def get_policy(name: str, **kwargs) -> CompressionPolicy:
    """A new instance of the policy registered under `name`, built with `kwargs`."""
    cls = get_policy_class(name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"policy {name!r} rejected policy_kwargs {sorted(kwargs)}: {e}") from None


__all__ = [
    "CompressionPolicy",
    "UnknownPolicyError",
    "available",
    "get_policy",
    "get_policy_class",
    "keep_forced_only",
    "keep_top_scores",
    "register_policy",
]
