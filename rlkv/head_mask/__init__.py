"""The head-mask artifact: what the gates learned, tied to the model it came from.

A `HeadMask` stores one score per (layer, KV head) - the clamped gate value `alpha` - plus a
fingerprint of the model (name, type, layers, KV heads, head dim). `full_heads(s)` turns the
scores into the boolean layout of a head-mixed cache at target sparsity `s`: the top
`round((1 - s) * L * H)` heads keep a full KV cache, the rest are compressed.

Modules: `artifact` (the `HeadMask` class), `fingerprint` (`ModelFingerprint`, `HeadMaskError`, the
checks of a score tensor), `formats` (JSON, TSV, DuoAttention / RLKV-authors files, folder layout),
`hub` (Hub download and upload, the model card), `ranking` (the order of heads, the full heads at a
sparsity). Every name below imports from `rlkv.head_mask` as it always has.
"""

from rlkv.head_mask.artifact import HeadMask
from rlkv.head_mask.fingerprint import HeadMaskError, ModelFingerprint
from rlkv.head_mask.formats import (
    DUO_CONFIG,
    DUO_TSV,
    FORMAT_NAME,
    FORMAT_VERSION,
    MASK_JSON,
    MASK_TSV,
    MAX_TOKENS,
    MODEL_CARD,
    RLKV_AUTHORS_TSV,
    TIE_BREAK_BELOW_ZERO,
)
from rlkv.ranking import rank_heads

__all__ = [
    "DUO_CONFIG",
    "DUO_TSV",
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "MASK_JSON",
    "MASK_TSV",
    "MAX_TOKENS",
    "MODEL_CARD",
    "RLKV_AUTHORS_TSV",
    "TIE_BREAK_BELOW_ZERO",
    "HeadMask",
    "HeadMaskError",
    "ModelFingerprint",
    "rank_heads",
]
