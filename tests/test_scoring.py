"""Shared scoring helpers (rlkv/policies/helpers/scoring.py) against plain loop references."""

import math

import pytest
import torch
import torch.nn.functional as F

from rlkv.cache import CompressedStore, CompressionSettings
from rlkv.policies.full import FullPolicy
from rlkv.policies.helpers.scoring import (
    masked_softmax,
    mean_over_queries,
    observation_attention,
    observation_logits,
    observation_window,
    pool_along_keys,
    pool_query_groups,
)

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)


def make_store(keys, positions, queries, query_positions, row_start, prompt_length, logical_length, groups):
    """A real CompressedStore holding the given tensors (as the cache would after some steps)."""
    settings = CompressionSettings(FullPolicy(), sink=0, window=0, budget=None, protect_prompt=True)
    store = CompressedStore(0, torch.arange(keys.shape[1]), groups, settings)
    store.keys, store.values, store.positions = keys, keys.clone(), positions
    store.all_valid = bool((positions >= 0).all())  # the host flag the cache keeps
    store.queries, store.query_positions = queries, query_positions
    store.row_start = row_start
    store.prompt_length, store.logical_length = prompt_length, logical_length
    store.evicted = torch.zeros(keys.shape[0], dtype=torch.long)
    return store


def random_store(seed=0, batch=2, heads=2, groups=2, slots=12, obs=3, dim=8):
    """Row 0 holds 12 consecutive positions; row 1 has three empty slots in the middle and a left-padded query."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(batch, heads, slots, dim, generator=g)
    queries = torch.randn(batch, heads, groups, obs, dim, generator=g)
    logical = 20
    positions = torch.arange(logical - slots, logical).expand(batch, heads, slots).clone()
    positions[1, :, 4:7] = -1
    query_positions = torch.arange(logical - obs, logical)
    row_start = torch.tensor([0, logical - obs + 1])  # row 1: its first observation query is padding
    return make_store(keys, positions, queries, query_positions, row_start, 5, logical, groups)


def reference_importance(store, exclude_window, kernel):
    """Loops: max over the group of raw logits, softmax over allowed keys, max-pool over valid neighbours, mean."""
    batch, heads, slots, dim = store.keys.shape
    out = torch.zeros(batch, heads, slots)
    first_obs = int(store.query_positions.min())
    for b in range(batch):
        for h in range(heads):
            pos = store.positions[b, h].tolist()
            real_queries = [
                n for n, p in enumerate(store.query_positions.tolist()) if p >= store.row_start[b]
            ]
            domain = [k for k in range(slots) if pos[k] >= 0 and not (exclude_window and pos[k] >= first_obs)]
            for n in real_queries:
                qpos = int(store.query_positions[n])
                allowed = [k for k in domain if pos[k] <= qpos]
                logits = {}
                for k in allowed:
                    dots = [
                        float(store.queries[b, h, g, n] @ store.keys[b, h, k])
                        for g in range(store.num_groups)
                    ]
                    logits[k] = max(dots) / math.sqrt(dim)
                top = max(logits.values())
                total = sum(math.exp(v - top) for v in logits.values())
                probs = {k: math.exp(v - top) / total for k, v in logits.items()}
                pooled_line = [probs.get(k, 0.0) for k in domain]
                for i, k in enumerate(domain):
                    lo, hi = max(0, i - kernel // 2), min(len(domain), i + kernel // 2 + 1)
                    out[b, h, k] += max(pooled_line[lo:hi]) / len(real_queries)
    return out


@pytest.mark.parametrize("exclude_window", [True, False])
@pytest.mark.parametrize("kernel", [1, 3, 7])
def test_observation_attention_matches_loop_reference(exclude_window, kernel):
    store = random_store()
    got = observation_attention(store, exclude_window=exclude_window, group_pool="max", kernel=kernel)
    want = reference_importance(store, exclude_window, kernel)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert (got[store.positions < 0] == 0).all()


def test_observation_logits_masks_padding_future_and_window():
    store = random_store()
    logits = observation_logits(store, exclude_window=False)
    assert logits.shape == (2, 2, 2, 3, 12)
    future = store.positions[:, :, None, None, :] > store.query_positions[None, None, None, :, None]
    assert torch.isinf(logits[future.expand_as(logits)]).all()
    assert torch.isinf(logits[1, :, :, 0]).all()  # padding query of row 1
    assert torch.isinf(logits[1, :, :, :, 4:7]).all()  # empty slots
    windowed = observation_logits(store, exclude_window=True)
    in_window = observation_window(store)
    assert torch.isinf(windowed[in_window[:, :, None, None, :].expand_as(windowed)]).all()
    assert (in_window.sum(-1) == 3).all()


def test_group_pooling_and_masked_softmax():
    logits = torch.randn(2, 3, 4, 5, 6)
    torch.testing.assert_close(pool_query_groups(logits, "max"), logits.max(dim=2).values)
    torch.testing.assert_close(pool_query_groups(logits, "mean"), logits.mean(dim=2))
    line = torch.tensor([[1.0, float("-inf"), 2.0, 0.5], [float("-inf")] * 4])
    probs = masked_softmax(line)
    torch.testing.assert_close(probs[0, [0, 2, 3]], torch.softmax(torch.tensor([1.0, 2.0, 0.5]), -1))
    assert probs[0, 1] == 0 and (probs[1] == 0).all()


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("kernel", [3, 7])
def test_pooling_matches_torch_on_full_rows_and_skips_empty_slots(mode, kernel):
    scores = torch.rand(2, 3, 4, 15)
    full = torch.ones(2, 3, 15, dtype=torch.bool)
    pool = F.max_pool1d if mode == "max" else F.avg_pool1d
    want = pool(scores.reshape(-1, 1, 15), kernel, stride=1, padding=kernel // 2).reshape(scores.shape)
    torch.testing.assert_close(pool_along_keys(scores, kernel, mode, full), want)
    torch.testing.assert_close(pool_along_keys(scores, kernel, mode, None), want)  # no mask: torch's pooling
    # empty slots anywhere: the result on the valid slots equals pooling the valid slots alone
    valid = full.clone()
    valid[:, :, [0, 5, 6, 11]] = False
    got = pool_along_keys(scores, kernel, mode, valid)
    kept = valid[0, 0]
    alone = pool(scores[..., kept].reshape(-1, 1, int(kept.sum())), kernel, stride=1, padding=kernel // 2)
    torch.testing.assert_close(got[..., kept], alone.reshape(2, 3, 4, -1))
    assert (got[..., ~kept] == 0).all()


def test_avg_pooling_without_pad_counts_divides_by_real_neighbours():
    scores = torch.tensor([[[1.0, 2.0, 3.0, 4.0]]])
    valid = torch.tensor([[[True, False, True, True]]])
    got = pool_along_keys(scores, 3, "avg", valid, count_include_pad=False)
    torch.testing.assert_close(got, torch.tensor([[[2.0, 0.0, (1 + 3 + 4) / 3, 3.5]]]))


def test_mean_over_queries_ignores_padding_queries():
    scores = torch.rand(2, 1, 3, 4)
    query_valid = torch.tensor([[True, True, True], [False, True, True]])
    got = mean_over_queries(scores, query_valid)
    torch.testing.assert_close(got[0], scores[0].mean(dim=1))
    torch.testing.assert_close(got[1], scores[1, :, 1:].mean(dim=1))


def test_bad_pooling_arguments_are_rejected():
    with pytest.raises(ValueError, match="odd"):
        pool_along_keys(torch.rand(1, 1, 4), 4, "max", torch.ones(1, 1, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="mode"):
        pool_along_keys(torch.rand(1, 1, 4), 3, "min", torch.ones(1, 1, 4, dtype=torch.bool))


@pytest.mark.parametrize("kernel", [1, 7])
def test_host_flags_skip_only_masks_that_are_all_true(kernel):
    """A store with no empty slot and no padded row (`all_valid`, `row_start_host` all 0) scores the
    same through the fast path (pooling in place, plain mean over queries) as through the masked one."""
    from rlkv.policies.snapkv import SnapKVPolicy

    g = torch.Generator().manual_seed(4)
    slots, obs, logical = 16, 4, 30
    positions = torch.arange(logical - slots, logical).expand(2, 2, slots).clone()
    store = make_store(
        torch.randn(2, 2, slots, 8, generator=g),
        positions,
        torch.randn(2, 2, 3, obs, 8, generator=g),
        torch.arange(logical - obs, logical),
        torch.zeros(2, dtype=torch.long),
        5,
        logical,
        3,
    )
    policy = SnapKVPolicy(window=obs, kernel=kernel)
    store.row_start_host = [0, 0]
    assert store.all_valid
    fast = (observation_attention(store, kernel=kernel), policy.scores(store))
    store.all_valid, store.row_start_host = False, None
    slow = (observation_attention(store, kernel=kernel), policy.scores(store))
    for a, b in zip(fast, slow, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the same terms, summed in another order
        assert (a[..., -obs:] == 0).all() and (a[..., :-obs] > 0).all()
