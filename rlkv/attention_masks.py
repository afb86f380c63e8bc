"""The SDPA mask function of rlkv's attention implementations (the inference cache's and the gates')."""

from __future__ import annotations

import torch
from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask


def decode_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, built without reading the attention mask back on a single-token step.

    To skip a mask, `sdpa_mask` checks on the host whether the padding mask is all ones: a host
    sync per forward. A one-token step always gets the boolean mask [B, 1, 1, K] instead (the
    attention functions that use this either drop it themselves when the batch is known unpadded,
    or read key validity and the query's column from it); longer forwards keep transformers' skip.
    For the plain causal pattern the one-query mask is built directly (a handful of ops instead of
    the general pattern's broadcast machinery), equal to `sdpa_mask`'s.
    """
    q_length = kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]
    if q_length == 1:
        if not args:
            direct = _one_query_causal_mask(**kwargs)
            if direct is not None:
                return direct
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _one_query_causal_mask(
    batch_size: int,
    kv_length: int,
    q_offset: int | torch.Tensor | None = None,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    use_vmap: bool = False,
    device: torch.device | str = "cpu",
    **_,
) -> torch.Tensor | None:
    """BoolTensor[B, 1, 1, K] of one query at position `q_offset` (keys `kv_offset + k` up to it, and not
    padding); None for anything but the plain causal pattern (another mask function, a local window,
    an older transformers' call without `q_offset`)."""
    if mask_function is not causal_mask_function or local_size is not None or use_vmap or q_offset is None:
        return None
    columns = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    allowed = columns <= q_offset
    padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
    if padding is None:
        return allowed.expand(batch_size, 1, 1, kv_length)
    return (padding[:, kv_offset : kv_offset + kv_length].bool() & allowed)[:, None, None, :]
