"""decode_mask's one-query fast path equals transformers' sdpa_mask (values, dtype, shape)."""

import pytest
import torch
from transformers.masking_utils import and_masks, causal_mask_function, sdpa_mask

from rlkv.attention_masks import decode_mask


@pytest.mark.parametrize("padding", [None, "left", "short"])
@pytest.mark.parametrize("dtype", [torch.long, torch.bool])
@pytest.mark.parametrize(
    "kv_offset, kv_length, q_offset", [(0, 9, 8), (0, 16, 8), (3, 6, 8), (0, 9, torch.tensor(8))]
)
def test_one_query_mask_equals_sdpa_mask(padding, dtype, kv_offset, kv_length, q_offset):
    batch = 3
    attention_mask = None
    if padding:
        width = 9 if padding == "left" else 7  # "short": a static cache's mask is narrower than kv_length
        attention_mask = torch.ones(batch, width, dtype=dtype)
        attention_mask[1, :2] = 0
        attention_mask[2, :5] = 0
    kwargs = dict(
        batch_size=batch,
        q_length=1,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        allow_is_causal_skip=True,
    )
    got = decode_mask(**kwargs)
    want = sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
    # transformers hands the mask function a bool padding mask; given a long one, sdpa_mask answers in long
    assert got.dtype == torch.bool and got.shape == want.shape == (batch, 1, 1, kv_length)
    assert torch.equal(got, want.bool())


def test_other_patterns_and_longer_queries_take_transformers_path():
    kwargs = dict(batch_size=2, q_length=1, kv_length=6, q_offset=5, kv_offset=0)
    window = and_masks(causal_mask_function, lambda b, h, q, k: k > q - 3)
    got = decode_mask(**kwargs, mask_function=window)
    assert torch.equal(got, sdpa_mask(**kwargs, mask_function=window, allow_is_causal_skip=False))
    assert got[0, 0, 0].tolist() == [False, False, False, True, True, True]
    assert (
        decode_mask(**{**kwargs, "q_length": 6, "q_offset": 0}) is None
    )  # prompt: transformers' causal skip
