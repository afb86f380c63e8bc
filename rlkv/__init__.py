"""rlkv: RL-learned head masks and head-mixed compressed KV caches for reasoning LLMs.

The names below load on first use (PEP 562), so `import rlkv.vllm_plugin` in every vLLM process does
not load the cache, the gates or the head-mask room.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "HeadGates": "rlkv.gates",
    "HeadMixedCache": "rlkv.cache",
    "HeadMask": "rlkv.head_mask",
    "HeadMaskError": "rlkv.head_mask",
    "ModelFingerprint": "rlkv.head_mask",
    "UnsupportedModelError": "rlkv.gates",
    "attach_gates": "rlkv.gates",
    "detach_gates": "rlkv.gates",
}
__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rlkv' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
