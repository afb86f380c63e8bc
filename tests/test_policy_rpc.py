"""RPC: selector-window scores vs a plain reference of the paper's equation, schedule, budgets, batching."""

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

from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies import get_policy
from rlkv.policies.rpc import CYCLES, RPCPolicy

P, R = 16, 4  # interval and selector window small enough for a tiny model's short generations


class RecordingRPC(RPCPolicy):
    """RPC that snapshots the store and its decision at every compression."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    def select(self, store):
        snapshot = {
            **store_snapshot(store),
            "cycle": store.state.get(CYCLES, 0) + 1,
            "scores": self.scores(store)[0].clone(),
        }
        keep = super().select(store)
        snapshot["keep"] = keep.clone()
        self.events.append(snapshot)
        return keep


def reference_scores(ev, kernel: int = 7) -> torch.Tensor:
    """The paper's importance, looped: softmax over the candidate region per selector and query head,
    summed over selectors, averaged over all heads of the layer, average-pooled (zero padding, /kernel)."""
    keys, positions, queries = ev["keys"].double(), ev["positions"], ev["queries"].double()
    batch, heads, slots, dim = keys.shape
    groups, num_q = queries.shape[2], queries.shape[3]
    first_selector = int(ev["query_positions"].min())
    scores = torch.zeros(batch, slots, dtype=torch.float64)
    for b in range(batch):
        cand = [k for k in range(slots) if ev["evictable"][b, 0, k] and positions[b, 0, k] < first_selector]
        cand.sort(key=lambda k: int(positions[b, 0, k]))
        summed = torch.zeros(len(cand), dtype=torch.float64)
        for h in range(heads):
            for g in range(groups):
                for n in range(num_q):
                    if not ev["query_valid"][b, n]:
                        continue
                    q = queries[b, h, g, n]
                    logits = torch.stack([q @ keys[b, h, k] / math.sqrt(dim) for k in cand])
                    summed += torch.softmax(logits, dim=0)
        summed /= heads * groups
        half = kernel // 2
        for i, k in enumerate(cand):
            window = [summed[j] for j in range(i - half, i + half + 1) if 0 <= j < len(cand)]
            scores[b, k] = sum(window) / kernel
    return scores


@pytest.fixture
def qwen2(make_model):
    return make_model("qwen2")


def test_scores_and_selection_match_the_paper(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    policy = RecordingRPC(interval=P, selector_window=R)
    generate_with(qwen2, policy, ids, mask, 3 * P + R + 4)
    assert [ev["num_generated"] for ev in policy.events if ev["layer"] == 0] == [P + R, 2 * P + R, 3 * P + R]
    kept_per_cycle = P // 4
    for ev in policy.events:
        ref = reference_scores(ev)
        torch.testing.assert_close(ev["scores"].double(), ref, atol=1e-6, rtol=0)
        first_selector = int(ev["query_positions"].min())
        valid = ev["positions"][:, 0] >= 0
        selectors = valid & (ev["positions"][:, 0] >= first_selector)
        candidates = ev["evictable"][:, 0] & ~selectors
        for b in range(ids.shape[0]):
            top = ref[b].masked_fill(~candidates[b], -1).topk(ev["cycle"] * kept_per_cycle).indices
            expected = ev["protected"][b, 0] | selectors[b]
            expected[top] = True
            assert ev["keep"][b].tolist() == expected.tolist()
            # RPC's target: cycle * P / c candidates + the R selectors, prompt untouched
            assert int((ev["keep"][b] & ev["evictable"][b, 0]).sum()) == ev["cycle"] * kept_per_cycle + R
            assert bool(ev["keep"][b][ev["protected"][b, 0]].all())


def test_one_selection_per_layer_and_counts_between_compressions(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    new = 2 * P + R + 7
    _, cache = generate_with(qwen2, RPCPolicy(interval=P, selector_window=R), ids, mask, new)
    fed = new - 1  # the last sampled token is never fed back
    for layer in cache.layers:
        store = layer.store
        assert bool((store.positions == store.positions[:, :1]).all())  # all heads hold the same tokens
        # after cycle 2 (at 2P + R generated): 2 * P/c + R kept, then one token per step
        assert store.num_evictable().tolist() == [[2 * P // 4 + R + fed - (2 * P + R)] * 2] * ids.shape[0]
        for b in range(ids.shape[0]):
            row_prompt = set(range(int(store.row_start[b]), ids.shape[1]))
            assert row_prompt <= set(store.positions[b, 0].tolist()), "prompt token evicted"


@pytest.mark.parametrize("budget", [12, 0.25])
def test_config_budget_overrides_the_target(qwen2, left_padded_batch, budget):
    ids, mask = left_padded_batch
    policy = RecordingRPC(interval=P, selector_window=R)
    _, cache = generate_with(qwen2, policy, ids, mask, 2 * P + R + 3, budget=budget)
    assert policy.events
    for ev in policy.events:
        kept = (ev["keep"] & ev["evictable"][:, 0]).sum(-1)
        assert kept.tolist() == ev["budget"].tolist()
    for layer in cache.layers:
        # between compressions a head holds at most budget + P evictable tokens (P is RPC's buffer)
        assert bool((layer.store.num_evictable() <= layer.store.budget[:, None] + P).all())


@pytest.mark.parametrize(("budget", "protect_prompt"), [(None, True), (0.3, False)])
def test_batch_rows_scored_independently(qwen2, left_padded_batch, budget, protect_prompt):
    """RPC's own target, and a per-row ratio budget with the prompt evictable (the eval setting)."""
    ids, mask = left_padded_batch
    assert_rows_independent(
        qwen2,
        lambda: RPCPolicy(interval=P, selector_window=R),
        ids,
        mask,
        2 * P + R + 2,
        sink=2,
        window=6,
        budget=budget,
        protect_prompt=protect_prompt,
    )


def test_budget_above_sequence_is_plain_generation(family, make_model, left_padded_batch):
    ids, mask = left_padded_batch
    model = make_model(family)
    assert_no_eviction_is_identity(
        model, lambda: RPCPolicy(interval=8, selector_window=R), ids, mask, 3 * 8 + R, budget=10_000
    )


def test_combined_mode_with_head_mask(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    assert_combined_mode(qwen2, RPCPolicy(interval=P, selector_window=R), ids, mask, 2 * P + R + 2)


def test_kwargs_from_compression_config(qwen2):
    cache = make_cache(qwen2, CompressionConfig(policy="rpc", policy_kwargs={"interval": 64, "ratio": 8}))
    assert (cache.policy.interval, cache.policy.kept_per_cycle, cache.policy.observe_queries) == (64, 8, 32)
    defaults = get_policy("rpc")
    assert (defaults.interval, defaults.selector_window, defaults.ratio, defaults.kernel) == (
        4096,
        32,
        4.0,
        7,
    )
    with pytest.raises(ValueError, match="kernel"):
        get_policy("rpc", kernel=4)
    with pytest.raises(TypeError, match="rejected policy_kwargs"):
        get_policy("rpc", window=8)
