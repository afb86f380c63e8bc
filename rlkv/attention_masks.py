"""The SDPA mask function of rlkv's attention implementations (the inference cache's and the gates')."""

from __future__ import annotations

import torch
from transformers.masking_utils import sdpa_mask


def decode_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, built without reading the attention mask back on a single-token step.

    To skip a mask, `sdpa_mask` checks on the host whether the padding mask is all ones: a host
    sync per forward. A one-token step always gets the boolean mask [B, 1, 1, K] instead (the
    attention functions that use this either drop it themselves when the batch is known unpadded,
    or read key validity and the query's column from it); longer forwards keep transformers' skip.
    """
    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if q_length == 1:
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)
