"""RLKV's training-time gates: one learnable alpha per (layer, KV head) mixing full and sink+local attention.

- `heads`: `HeadGates`, `attach_gates` / `detach_gates` (freeze the model, switch its attention),
  `full_attention` (the gated model's stock attention for a block: the full-attention reference),
  `contiguous_head_inputs` (keeps a frozen LM head from copying its weight per row);
- `attention`: the "rlkv_mixed" attention function the gated model runs (training and generate).
"""

from rlkv.gates.heads import (
    HeadGates,
    UnsupportedModelError,
    attach_gates,
    contiguous_head_inputs,
    detach_gates,
    full_attention,
)

__all__ = [
    "HeadGates",
    "UnsupportedModelError",
    "attach_gates",
    "contiguous_head_inputs",
    "detach_gates",
    "full_attention",
]
