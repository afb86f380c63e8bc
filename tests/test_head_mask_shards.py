"""A head mask cut balanced for tensor parallelism (issue 78): `HeadMask.full_heads(s, shards=k)` keeps every
layer's full heads a multiple of k, each layer's most important ones, within k / 2 heads of the plain count."""

from __future__ import annotations

import pytest
import torch

from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint
from rlkv.testing import tiny_model

SPARSITIES = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.875, 1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=6, num_key_value_heads=4, num_attention_heads=8)


def _masks(model, count=5):
    return [HeadMask.random(model, seed=seed) for seed in range(count)]


def _within_layer_rank(mask: HeadMask) -> torch.Tensor:
    """[L, H]: each head's place in its layer's ranking (0 = the layer's most important)."""
    order = mask.order().tolist()[::-1]  # most important first
    place = torch.zeros_like(mask.scores, dtype=torch.long)
    seen = [0] * mask.scores.shape[0]
    for layer, head in order:
        place[layer, head] = seen[layer]
        seen[layer] += 1
    return place


def test_one_shard_is_the_plain_cut_bitwise(model):
    for mask in _masks(model):
        for s in SPARSITIES:
            assert torch.equal(mask.full_heads(s, shards=1), mask.full_heads(s))


@pytest.mark.parametrize("shards", [2, 4])
def test_every_layer_keeps_a_multiple_of_shards_of_its_top_heads(model, shards):
    for mask in _masks(model):
        place = _within_layer_rank(mask)
        for s in SPARSITIES:
            full = mask.full_heads(s, shards=shards)
            per_layer = full.sum(dim=1)
            assert (per_layer % shards == 0).all(), per_layer
            # a layer keeping n heads keeps exactly its n most important ones
            assert torch.equal(full, place < per_layer[:, None])
            assert abs(int(full.sum()) - mask.num_full_heads(s)) <= shards / 2
            assert torch.equal(full, mask.full_heads(s, shards=shards))  # deterministic


def test_the_kept_groups_are_the_best_ranked(model):
    """Balanced at 2 shards, a kept group never ranks below a dropped one (by the mean rank of its heads)."""
    for mask in _masks(model):
        order = mask.order().tolist()[::-1]
        rank = {tuple(pair): i for i, pair in enumerate(order)}
        place = _within_layer_rank(mask)
        for s in SPARSITIES:
            full = mask.full_heads(s, shards=2)
            kept, dropped = [], []
            for layer in range(full.shape[0]):
                heads = sorted(range(full.shape[1]), key=lambda h, layer=layer: int(place[layer, h]))
                for g in range(0, len(heads), 2):
                    total = sum(rank[(layer, h)] for h in heads[g : g + 2])
                    (kept if full[layer, heads[g]] else dropped).append(total)
            if kept and dropped:
                assert max(kept) <= min(dropped)


def test_min_full_per_layer_is_kept_rounded_up_to_whole_groups(model):
    mask = _masks(model, 1)[0]
    full = mask.full_heads(0.875, min_full_per_layer=1, shards=2)
    assert (full.sum(dim=1) >= 2).all() and (full.sum(dim=1) % 2 == 0).all()


@pytest.mark.parametrize(
    "shards, match",
    [
        (0, r"shards=0: a positive integer"),
        (True, r"shards=True"),
        (3, r"4 KV heads per layer do not divide"),
    ],
)
def test_bad_shard_counts_are_refused_naming_the_field(model, shards, match):
    with pytest.raises(HeadMaskError, match=match):
        _masks(model, 1)[0].full_heads(0.5, shards=shards)


def test_a_two_kv_head_model_balances_whole_layers():
    model = tiny_model("llama", num_hidden_layers=4, num_key_value_heads=2)
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.2, 0.3], [0.95, 0.05]])
    mask = HeadMask(scores=scores, fingerprint=ModelFingerprint.of(model))
    # plain s=0.5 keeps 0.0, 1.0, 1.1, 3.0; balanced keeps the two layers of the best mean rank: layer 1
    # (ranks 2, 3), then layer 0 (1, 6), tied with layer 3 (0, 7) and taken as the lower layer
    assert mask.full_heads(0.5).sum(dim=1).tolist() == [1, 2, 0, 1]
    assert mask.full_heads(0.5, shards=2).sum(dim=1).tolist() == [2, 2, 0, 0]
