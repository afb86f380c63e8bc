"""Token-eviction policies for the compressed heads of a `HeadMixedCache`, by name.

`get_policy(name, **kwargs)` builds one, `available()` lists the names, `@register_policy(name)`
adds a class. The interface a policy implements is documented in `rlkv/policies/base.py`.
Built-in policies live in one module each under `rlkv/policies/` and register on import.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import typing
from collections.abc import Callable
from typing import Any

from rlkv.errors import UserError
from rlkv.policies.base import CompressionPolicy, keep_forced_only, keep_top_scores

_REGISTRY: dict[str, type[CompressionPolicy]] = {}
_BUILTINS_LOADED = False


class UnknownPolicyError(ValueError, UserError):
    """A policy name that no registered policy has."""


class PolicyArgumentError(TypeError, ValueError, UserError):
    """A `policy_kwargs` key that is not one of the policy's fields (a TypeError, as Python's own for an
    unexpected keyword), or a value of the wrong type for its field (a bad value: a ValueError too)."""


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
    """A new instance of the policy registered under `name`, built with `kwargs`.

    Each key must be one of the policy's fields and each value of the field's type (an int field takes an
    integer, a float field a number, a bool field True/False, a choice field one of its choices): a
    `PolicyArgumentError` names the field otherwise, where a plain construction would truncate 1.5 to 1.
    Ranges are the policy's own checks (`ValueError` from its `__post_init__`).
    """
    cls = get_policy_class(name)
    _check_fields(name, cls, kwargs)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise PolicyArgumentError(f"policy {name!r} rejected policy_kwargs {sorted(kwargs)}: {e}") from None


def _check_fields(name: str, cls: type[CompressionPolicy], kwargs: dict[str, Any]) -> None:
    """Refuse a key that names no field of `cls` and a value that does not fit the field's annotation."""
    accepted = (
        {f.name: f for f in dataclasses.fields(cls) if f.init} if dataclasses.is_dataclass(cls) else None
    )
    if accepted is None:
        return
    hints = typing.get_type_hints(cls)
    for key, value in kwargs.items():
        if key not in accepted:
            raise PolicyArgumentError(
                f"policy {name!r} rejected policy_kwargs {sorted(kwargs)}: it has no field {key!r} "
                f"(its fields: {', '.join(sorted(accepted)) or 'none'})"
            )
        wanted = _expected(hints.get(key), value)
        if wanted is not None:
            raise PolicyArgumentError(
                f"{name}: {key}={value!r} must be {wanted} (a field of policy {name!r})"
            )


def _expected(hint: Any, value: Any) -> str | None:
    """What `value` should have been for annotation `hint` (None: it fits, or the hint is not checked)."""
    if hint is int:
        whole = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        return None if whole and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(hint) is typing.Literal:
        choices = typing.get_args(hint)
        return None if value in choices else "one of " + ", ".join(map(repr, choices))
    return None  # unions, objects (a tokenizer, a path): the policy checks them


__all__ = [
    "CompressionPolicy",
    "PolicyArgumentError",
    "UnknownPolicyError",
    "available",
    "get_policy",
    "get_policy_class",
    "keep_forced_only",
    "keep_top_scores",
    "register_policy",
]
