"""R-KV: importance, redundancy (with the recent-key exemption) and selection vs plain loop references."""

import math

import pytest
import torch
from policy_properties import (
    assert_combined_mode,
    assert_no_eviction_is_identity,
    assert_rows_independent,
    generate_with,
    store_snapshot,
)

from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies import get_policy
from rlkv.policies.rkv import RKVPolicy, key_redundancy

BUDGET, BUFFER = 24, 8
CACHE = dict(budget=BUDGET, sink=2, window=6)


class RecordingRKV(RKVPolicy):
    """R-KV that snapshots the store, its scores and its decision at every compression."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    def select(self, store):
        event = {**store_snapshot(store), "scores": self.scores(store).clone()}
        event["keep"] = super().select(store).clone()
        self.events.append(event)
        return event["keep"]


def reference_redundancy(keys, positions, valid, threshold, exempt):
    """R-KV's redundancy, looped: cos sim, zero diagonal, exempt the most recent similar keys, mean, softmax."""
    keys = keys.double()
    batch, heads, slots, _ = keys.shape
    out = torch.zeros(batch, heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            real = [k for k in range(slots) if valid[b, h, k]]
            unit = keys[b, h, real] / (keys[b, h, real].norm(dim=-1, keepdim=True) + 1e-8)
            sim = unit @ unit.T
            sim.fill_diagonal_(0.0)
            pos = positions[b, h, real].tolist()
            for i in range(len(real)):
                similar = sorted(
                    (j for j in range(len(real)) if sim[i, j] > threshold), key=lambda j: -pos[j]
                )
                for j in similar[:exempt]:
                    sim[i, j] = 0.0
            out[b, h, real] = torch.softmax(sim.mean(dim=0), dim=0)
    return out


def reference_importance(ev, kernel=7):
    """R-KV's importance, looped: per observation query, max over the group of raw logits, softmax over
    keys outside the observation window, max-pool over neighbouring kept keys, mean over the queries."""
    keys, queries, positions = ev["keys"].double(), ev["queries"].double(), ev["positions"]
    batch, heads, slots, dim = keys.shape
    first_obs = int(ev["query_positions"].min())
    out = torch.zeros(batch, heads, slots, dtype=torch.float64)
    for b in range(batch):
        real_queries = [n for n in range(queries.shape[3]) if ev["query_valid"][b, n]]
        for h in range(heads):
            cand = [k for k in range(slots) if 0 <= positions[b, h, k] < first_obs]
            cand.sort(key=lambda k: int(positions[b, h, k]))
            for n in real_queries:
                per_head = queries[b, h, :, n] @ keys[b, h, cand].T  # [G, candidates]
                probs = torch.softmax(per_head.max(dim=0).values / math.sqrt(dim), dim=0)
                for i, k in enumerate(cand):
                    lo, hi = max(0, i - kernel // 2), min(len(cand), i + kernel // 2 + 1)
                    out[b, h, k] += probs[lo:hi].max() / len(real_queries)
    return out


@pytest.fixture
def qwen2(make_model):
    return make_model("qwen2")


@pytest.mark.parametrize("chunk", [1, 5, 1024])
def test_redundancy_matches_reference_with_recent_exemption(chunk):
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 11, 8, generator=g)
    base = keys[0, 0, 1].clone()
    for slot, noise in ((4, 0.05), (7, 0.1), (9, 0.0)):  # near copies of slot 1: a cluster of similar keys
        keys[0, 0, slot] = base + noise * torch.randn(8, generator=g)
    positions = torch.arange(11).expand(2, 2, 11).clone()
    positions[1, 1, [2, 3]] = -1  # empty slots take no part
    valid = positions >= 0
    for exempt in (0, 1, 2):
        got = key_redundancy(keys, valid, threshold=0.5, recent_exempt=exempt, chunk=chunk)
        want = reference_redundancy(keys, positions, valid, 0.5, exempt)
        torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=0)
    # the exemption matters: the most recent copy of the cluster is the least redundant of it
    r = key_redundancy(keys, valid, 0.5, 1, chunk)[0, 0]
    assert r[9] < r[1] and r[9] < r[4]
    assert (got[1, 1, [2, 3]] == 0).all()
    # no empty slot: `valid=None` builds no mask and gives the same scores as an all-True mask
    every = torch.ones_like(valid)
    for exempt in (0, 1, 2):
        masked = key_redundancy(keys, every, 0.5, exempt, chunk)
        torch.testing.assert_close(key_redundancy(keys, None, 0.5, exempt, chunk), masked, atol=0, rtol=0)


def test_scores_and_selection_match_the_paper(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    policy = RecordingRKV(buffer=BUFFER)
    generate_with(qwen2, policy, ids, mask, 3 * BUFFER + BUDGET + 2, **CACHE)
    assert len(policy.events) >= 2 * qwen2.config.num_hidden_layers
    for ev in policy.events:
        valid = ev["positions"] >= 0
        redundancy = reference_redundancy(ev["keys"], ev["positions"], valid, 0.5, 1)
        want = 0.1 * reference_importance(ev) - 0.9 * redundancy
        torch.testing.assert_close(ev["scores"].double(), want, atol=1e-6, rtol=0)
        # keep = forced + observation tokens + the best candidates, budget - (forced evictable) of them
        obs = valid & (ev["positions"] >= ev["query_positions"].min())
        batch, heads, _ = valid.shape
        for b in range(batch):
            for h in range(heads):
                cand = [
                    k
                    for k in range(valid.shape[-1])
                    if ev["evictable"][b, h, k] and not ev["forced"][b, h, k]
                ]
                cand.sort(key=lambda k: (not obs[b, h, k], -float(want[b, h, k])))
                extra = int(ev["budget"][b]) - int((ev["forced"][b, h] & ev["evictable"][b, h]).sum())
                expected = ev["forced"][b, h].clone()
                expected[cand[:extra]] = True
                assert ev["keep"][b, h].tolist() == expected.tolist()
                assert int((ev["keep"][b, h] & ev["evictable"][b, h]).sum()) == BUDGET


def test_kept_counts_within_budget_plus_buffer_and_prompt_kept(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    cache = make_cache(qwen2, CompressionConfig(policy="rkv", policy_kwargs={"buffer": BUFFER}, **CACHE))
    seen = []

    def check(module, args, kwargs, output):
        for layer in cache.layers:
            store = layer.store
            counts = store.num_evictable()
            assert bool((counts <= BUDGET + BUFFER).all())
            seen.append(int(counts.max()))
            for b in range(ids.shape[0]):
                prompt = set(range(int(store.row_start[b]), ids.shape[1]))
                assert prompt <= set(store.positions[b, 0].tolist()), "prompt token evicted"
                assert not (set(range(int(store.row_start[b]))) & set(store.positions[b].flatten().tolist()))

    handle = qwen2.register_forward_hook(check, with_kwargs=True)
    try:
        qwen2.generate(
            input_ids=ids,
            attention_mask=mask,
            **cache_kwargs(cache),
            max_new_tokens=3 * BUFFER + BUDGET + 3,
            min_new_tokens=3 * BUFFER + BUDGET + 3,
            do_sample=False,
            pad_token_id=0,
        )
    finally:
        handle.remove()
    assert (
        max(seen) == BUDGET + BUFFER - 1 and BUDGET in seen
    )  # compressed every BUFFER tokens, back to BUDGET


def test_dynamic_ratio_budget(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    _, cache = generate_with(qwen2, RKVPolicy(buffer=4), ids, mask, 40, budget=0.5, sink=2, window=6)
    for layer in cache.layers:
        store = layer.store
        assert bool((store.num_evictable() <= store.budget[:, None] + 4).all())
        assert int(store.evicted.sum()) > 0


def test_batch_rows_scored_independently(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    assert_rows_independent(
        qwen2, lambda: RKVPolicy(buffer=BUFFER), ids, mask, 2 * BUFFER + BUDGET + 2, **CACHE
    )


def test_budget_above_sequence_is_plain_generation(family, make_model, left_padded_batch):
    ids, mask = left_padded_batch
    assert_no_eviction_is_identity(
        make_model(family), lambda: RKVPolicy(buffer=4), ids, mask, 20, budget=10_000
    )


def test_combined_mode_with_head_mask(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    assert_combined_mode(qwen2, RKVPolicy(buffer=BUFFER), ids, mask, 2 * BUFFER + BUDGET + 2, **CACHE)


def test_kwargs_defaults_and_errors(qwen2):
    defaults = get_policy("rkv")
    assert (defaults.window, defaults.kernel, defaults.lam, defaults.threshold) == (8, 7, 0.1, 0.5)
    assert (defaults.recent_exempt, defaults.buffer, defaults.default_budget, defaults.observe_queries) == (
        1,
        128,
        1024,
        8,
    )
    config = CompressionConfig(policy="rkv", policy_kwargs={"lam": 0.07, "window": 4, "buffer": 64})
    cache = make_cache(qwen2, config)
    assert (cache.policy.lam, cache.policy.observe_queries, cache.policy.buffer) == (0.07, 4, 64)
    with pytest.raises(ValueError, match="kernel"):
        get_policy("rkv", kernel=4)
    with pytest.raises(TypeError, match="rejected policy_kwargs"):
        get_policy("rkv", budget=3)
