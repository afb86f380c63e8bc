"""The "rlkv_cache" attention function: attention over a `HeadMixedCache`'s split storage.

Registered with transformers' `AttentionInterface` and `AttentionMaskInterface` under `ATTENTION_NAME`
(the mask is the stock boolean SDPA mask over logical positions); `rlkv.inference.make_cache` / `load`
activate it with `model.set_attn_implementation(ATTENTION_NAME)`. When the model runs without a
`HeadMixedCache` (plain tensors come back from the cache update, or no cache), it is plain SDPA.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlkv.cache import HeadMixedLayer

ATTENTION_NAME = "rlkv_cache"


def rlkv_cache_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor | HeadMixedLayer,
    value: torch.Tensor | HeadMixedLayer,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention output [B, Q, H_q, D]; `key` is the `HeadMixedLayer` returned by `HeadMixedCache.update`."""
    if isinstance(key, HeadMixedLayer):
        if dropout:
            raise ValueError(
                "rlkv_cache attention is for inference: call model.eval() (attention dropout > 0)"
            )
        return key.attend(
            module, query, attention_mask, scaling if scaling is not None else query.shape[-1] ** -0.5
        ), None
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


def register_attention() -> str:
    """Register the attention and mask functions (idempotent); returns their name."""
    AttentionInterface.register(ATTENTION_NAME, rlkv_cache_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME


register_attention()
