"""A head mask cut balanced for tensor parallelism (issue 78): `HeadMask.full_heads(s, shards=k)` keeps every
layer's full heads a multiple of k, each layer's most important ones, within k / 2 heads of the plain count.

Also under ties (scores and tie-breaks that tie, every head count, every `min_full_per_layer`): a balanced cut's
total is the multiple of `shards` nearest the plain count, |total - count| <= shards / 2 (the best any multiple
can do), unless the per-layer reservation rounded up to whole groups, L * ceil(m / shards) * shards, alone
exceeds it."""

from __future__ import annotations

import pytest
import torch

from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint
from rlkv.ranking import rank_heads, select_full_heads
from rlkv.testing import tiny_model

SPARSITIES = (0.0, 0.1, 0.25, 0.4, 0.5, 0.6, 0.75, 0.875, 1.0)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_hidden_layers=6, num_key_value_heads=4, num_attention_heads=8)


def _masks(model, count=5):
    return [HeadMask.random(model, seed=seed) for seed in range(count)]


def test_one_shard_is_the_plain_cut_bitwise(model):
    for mask in _masks(model):
        for s in SPARSITIES:
            assert torch.equal(mask.full_heads(s, shards=1), mask.full_heads(s))


@pytest.mark.parametrize("shards", [2, 4])
def test_every_layer_keeps_a_multiple_of_shards_of_its_top_heads(model, shards):
    for mask in _masks(model):
        place = _place(mask)
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
        place = _place(mask)
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


def test_a_two_kv_head_model_balances_whole_layers():
    model = tiny_model("llama", num_hidden_layers=4, num_key_value_heads=2)
    scores = torch.tensor([[0.9, 0.1], [0.8, 0.7], [0.2, 0.3], [0.95, 0.05]])
    mask = HeadMask(scores=scores, fingerprint=ModelFingerprint.of(model))
    # plain s=0.5 keeps 0.0, 1.0, 1.1, 3.0; balanced keeps the two layers of the best mean rank: layer 1
    # (ranks 2, 3), then layer 0 (1, 6), tied with layer 3 (0, 7) and taken as the lower layer
    assert mask.full_heads(0.5).sum(dim=1).tolist() == [1, 2, 0, 1]
    assert mask.full_heads(0.5, shards=2).sum(dim=1).tolist() == [2, 2, 0, 0]


def _tied_masks(layers: int, heads: int, count: int = 4) -> list[HeadMask]:
    """Masks whose scores take 4 values and (every other one) carry a 0/1 tie-break: index decides many ties."""
    fp = ModelFingerprint.of(
        tiny_model("llama", num_hidden_layers=layers, num_key_value_heads=heads, num_attention_heads=8)
    )
    masks = []
    for seed in range(count):
        g = torch.Generator().manual_seed(seed)
        scores = (torch.rand(layers, heads, generator=g) * 4).floor() / 4
        tie_break = (torch.rand(layers, heads, generator=g) * 2).floor() if seed % 2 else None
        masks.append(HeadMask(scores=scores, fingerprint=fp, tie_break=tie_break))
    return masks


def _place(mask: HeadMask) -> torch.Tensor:
    """[L, H]: each head's place in its layer by `rank_heads` (0 = the layer's most important)."""
    heads = mask.num_kv_heads
    place = torch.empty_like(mask.scores, dtype=torch.long)
    seen = [0] * mask.num_layers
    for idx in rank_heads(mask.scores, mask.tie_break).tolist():
        place[idx // heads, idx % heads] = seen[idx // heads]
        seen[idx // heads] += 1
    return place


@pytest.mark.parametrize("layers, heads", [(5, 4), (3, 8)])
def test_one_shard_is_the_plain_selection_at_every_count(layers, heads):
    for mask in _tied_masks(layers, heads):
        for k in range(layers * heads + 1):
            s = 1 - k / (layers * heads)
            for m in (0, 1, heads):
                plain = select_full_heads(mask.scores, mask.tie_break, mask.num_full_heads(s), m)
                assert torch.equal(mask.full_heads(s, min_full_per_layer=m, shards=1), plain)
                assert torch.equal(mask.full_heads(s, min_full_per_layer=m), plain)


@pytest.mark.parametrize("layers, heads, shards", [(5, 4, 2), (5, 4, 4), (3, 8, 2), (3, 8, 4), (3, 8, 8)])
def test_balanced_cut_under_ties_at_every_count_and_reservation(layers, heads, shards):
    worst = 0
    for mask in _tied_masks(layers, heads):
        place = _place(mask)
        for k in range(layers * heads + 1):
            s = 1 - k / (layers * heads)
            count = mask.num_full_heads(s)
            for m in range(heads + 1):
                full = mask.full_heads(s, min_full_per_layer=m, shards=shards)
                per_layer = full.sum(dim=1)
                assert (per_layer % shards == 0).all() and (per_layer >= m).all(), (k, m, per_layer)
                assert torch.equal(full, place < per_layer[:, None])  # each layer's top-ranked heads
                assert torch.equal(full, mask.full_heads(s, min_full_per_layer=m, shards=shards))
                reserved = layers * -(-m // shards) * shards
                if reserved > count:
                    assert int(full.sum()) == reserved
                else:
                    assert abs(int(full.sum()) - count) <= shards / 2, (k, m, int(full.sum()))
                    worst = max(worst, abs(int(full.sum()) - count))
    assert worst == shards // 2  # the bound is reached: no tighter one holds


@pytest.mark.parametrize(
    "shards, match",
    [
        (0, r"shards=0: a positive integer"),
        (-2, r"shards=-2: a positive integer"),
        (False, r"shards=False: a positive integer"),
        (2.0, r"shards=2.0: a positive integer"),
        (3, r"4 KV heads per layer do not divide among 3 shards; choose a shard count that divides 4"),
        (8, r"do not divide among 8 shards"),
    ],
)
def test_refusals_name_the_field_and_the_fix(shards, match):
    with pytest.raises(HeadMaskError, match=match):
        _tied_masks(2, 4, count=1)[0].full_heads(0.5, shards=shards)
