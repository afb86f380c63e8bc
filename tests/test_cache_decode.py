"""Decode attention split along the keys (rlkv/cache/decode.py): when it splits, and that it equals
one SDPA pass up to float rounding, alone and inside generation."""

import pytest
import torch
from policy_properties import generate_with_logits

from rlkv import HeadMask
from rlkv.cache import decode
from rlkv.policies import get_policy

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)

LONG = 4 * decode.MIN_SPLIT_TOKENS


def _history(batch: int, heads: int, length: int, spare: int = 7, dtype=torch.float32):
    """Keys and values [B, H, length, 16] as prefix views of storages with `spare` more tokens (as the
    cache holds them)."""
    gen = torch.Generator().manual_seed(0)
    keys, values = (
        torch.randn(batch, heads, length + spare, 16, generator=gen, dtype=dtype) for _ in range(2)
    )
    return keys[:, :, :length], values[:, :, :length]


@pytest.mark.parametrize(
    "batch, heads, threads, length, splits",
    [
        (1, 5, 2, LONG, 2),  # 5 pairs on 2 threads: 3 + 2 units; split in 2: 5 + 5 half units
        (1, 3, 2, LONG, 2),
        (1, 8, 2, LONG, 1),  # already balanced: no split
        (8, 5, 2, LONG, 1),
        (1, 5, 1, LONG, 1),  # one thread: nothing to balance
        (1, 4, 16, LONG, 4),  # 4 pairs on 16 threads: 4 parts each, capped by the keys per part
        (1, 5, 2, decode.MIN_SPLIT_TOKENS + 1, 1),  # parts would be shorter than MIN_SPLIT_TOKENS
    ],
)
def test_splits_only_when_more_threads_get_work(batch, heads, threads, length, splits):
    keys, values = _history(batch, heads, length, spare=0)
    assert decode.decode_splits(keys, values, threads) == splits


def test_no_split_off_cpu_layouts():
    keys, values = _history(1, 5, LONG)
    strided = keys.transpose(0, 1)  # (row, head) pairs not equally spaced: no view of parts without a copy
    assert decode.decode_splits(strided, values.transpose(0, 1), 2) == 1
    assert decode.decode_splits(keys, values, 2) == 2


@pytest.mark.parametrize("length", [LONG, LONG + 3])  # T % splits = 0, and a tail
@pytest.mark.parametrize("splits", [2, 3])
def test_split_attention_equals_one_pass(length, splits):
    keys, values = _history(2, 3, length)
    query = torch.randn(2, 3, 4, 16, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=0.25)
    got = decode.split_attention(query, keys, values, 0.25, splits)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_split_attention_keeps_bf16():
    keys, values = _history(1, 5, LONG, dtype=torch.bfloat16)
    query = torch.randn(1, 5, 4, 16).to(torch.bfloat16)
    want = torch.nn.functional.scaled_dot_product_attention(query, keys, values, scale=0.25)
    got = decode.split_attention(query, keys, values, 0.25, 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_generation_with_split_decode_matches_one_pass(make_model, monkeypatch):
    """Three threads and a tiny split threshold: the full heads' decode attention (one full head per
    layer, B=1) is split in three, and greedy tokens and logits match the unsplit run."""
    model = make_model("llama")
    prompt = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    full_heads = HeadMask.random(model, seed=3).full_heads(0.5, min_full_per_layer=1)

    def greedy():
        policy = get_policy("streaming")
        args = (model, policy, prompt, torch.ones_like(prompt), 12)
        tokens, logits, _ = generate_with_logits(*args, full_heads=full_heads, sink=4, window=8)
        return tokens, logits

    want_tokens, want_logits = greedy()
    calls = []
    split = decode.split_attention

    def spy(query, keys, values, scale, splits):
        calls.append(splits)
        return split(query, keys, values, scale, splits)

    monkeypatch.setattr(decode, "MIN_SPLIT_TOKENS", 8)
    monkeypatch.setattr("rlkv.cache.attention.split_attention", spy)
    torch.set_num_threads(3)  # restored by conftest
    got_tokens, got_logits = greedy()
    assert calls and set(calls) == {3}  # one full KV head per layer on 3 threads
    assert torch.equal(got_tokens, want_tokens)
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-4, atol=1e-5)
