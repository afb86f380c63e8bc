"""rlkv: RL-learned head masks and head-mixed compressed KV caches for reasoning LLMs."""

from rlkv.cache import HeadMixedCache
from rlkv.gates import HeadGates, UnsupportedModelError, attach_gates, detach_gates
from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint

__all__ = [
    "HeadGates",
    "HeadMixedCache",
    "HeadMask",
    "HeadMaskError",
    "ModelFingerprint",
    "UnsupportedModelError",
    "attach_gates",
    "detach_gates",
]
__version__ = "0.1.0"
