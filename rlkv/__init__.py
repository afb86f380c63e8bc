"""rlkv: RL-learned head masks and head-mixed compressed KV caches for reasoning LLMs."""

from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint

__all__ = ["HeadMask", "HeadMaskError", "ModelFingerprint"]
__version__ = "0.1.0"
