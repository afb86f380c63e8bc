"""SnapKV (decode-adapted): observation-window importance vs a looped reference, buffer schedule, batching."""

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
from rlkv.policies.snapkv import SnapKVPolicy

BUDGET, BUFFER = 16, 8


class RecordingSnapKV(SnapKVPolicy):
    """SnapKV that snapshots the store and its decision at every compression."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.events = []

    def select(self, store):
        snapshot = {**store_snapshot(store), "scores": self.scores(store).clone()}
        keep = super().select(store)
        snapshot["keep"] = keep.clone()
        self.events.append(snapshot)
        return keep


def reference_scores(ev, group_pool: str, pooling: str, kernel: int = 7) -> torch.Tensor:
    """Importance per (row, KV head, slot), looped: for each real observation query, softmax over the
    valid keys before the observation window (max of the group's raw logits first, or the mean of
    the query heads' softmax), pooled over adjacent such keys, then averaged over the queries."""
    keys, positions, queries = ev["keys"].double(), ev["positions"], ev["queries"].double()
    batch, heads, slots, dim = keys.shape
    groups = queries.shape[2]
    window_start = int(ev["query_positions"].min())
    half = kernel // 2
    scores = torch.zeros(batch, heads, slots, dtype=torch.float64)
    for b in range(batch):
        for h in range(heads):
            domain = [k for k in range(slots) if 0 <= positions[b, h, k] < window_start]
            domain.sort(key=lambda k: int(positions[b, h, k]))
            per_query = []
            for n in range(queries.shape[3]):
                if not ev["query_valid"][b, n]:
                    continue
                logits = torch.stack(
                    [
                        torch.stack([queries[b, h, g, n] @ keys[b, h, k] / math.sqrt(dim) for k in domain])
                        for g in range(groups)
                    ]
                )
                if group_pool == "max":
                    probs = torch.softmax(logits.max(dim=0).values, dim=0)
                else:
                    probs = torch.softmax(logits, dim=1).mean(dim=0)
                pooled = []
                for i in range(len(domain)):
                    near = probs[max(0, i - half) : i + half + 1]
                    pooled.append(near.max() if pooling == "max" else near.sum() / kernel)
                per_query.append(torch.stack(pooled))
            mean = torch.stack(per_query).mean(dim=0)
            for i, k in enumerate(domain):
                scores[b, h, k] = mean[i]
    return scores


@pytest.fixture
def qwen2(make_model):
    return make_model("qwen2")


@pytest.mark.parametrize(
    "settings",
    [
        {"window": 8, "pooling": "max", "group_pool": "max"},  # R-KV's SnapKV baseline (defaults)
        {"window": 12, "pooling": "avg", "group_pool": "mean"},  # SnapKV paper style
    ],
)
def test_scores_and_selection_match_reference(qwen2, left_padded_batch, settings):
    ids, mask = left_padded_batch
    policy = RecordingSnapKV(buffer=BUFFER, **settings)
    _, cache = generate_with(
        qwen2, policy, ids, mask, BUDGET + 3 * BUFFER + 3, budget=BUDGET, sink=1, window=2
    )
    # every (row, head) starts evicting at budget + buffer generated tokens, then every buffer tokens
    starts = [ev["num_generated"] for ev in policy.events if ev["layer"] == 0]
    assert starts == [BUDGET + BUFFER, BUDGET + 2 * BUFFER, BUDGET + 3 * BUFFER]
    for ev in policy.events:
        ref = reference_scores(ev, settings["group_pool"], settings["pooling"])
        torch.testing.assert_close(ev["scores"].double(), ref, atol=1e-6, rtol=0)
        window_start = int(ev["query_positions"].min())
        batch, heads, _ = ev["positions"].shape
        for b in range(batch):
            for h in range(heads):
                evictable = ev["evictable"][b, h]
                observed = evictable & (ev["positions"][b, h] >= window_start)
                fixed = observed | (ev["forced"][b, h] & evictable)
                room = BUDGET - int(fixed.sum())
                # max pooling copies values to neighbours: equal scores break towards the older token
                candidates = (evictable & ~fixed).nonzero().flatten().tolist()
                candidates.sort(key=lambda k: (-float(ref[b, h, k]), int(ev["positions"][b, h, k])))
                top = candidates[:room]
                expected = ev["forced"][b, h] | observed
                expected[top] = True
                assert ev["keep"][b, h].tolist() == expected.tolist()
                assert int((ev["keep"][b, h] & evictable).sum()) == BUDGET
    for layer in cache.layers:
        assert bool((layer.store.num_evictable() < BUDGET + BUFFER).all())


def test_prompt_kept(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    _, cache = generate_with(qwen2, SnapKVPolicy(buffer=4), ids, mask, 40, budget=12, window=2)
    for layer in cache.layers:
        store = layer.store
        assert store.evicted.sum() > 0
        for b in range(ids.shape[0]):
            prompt = set(range(int(store.row_start[b]), ids.shape[1]))
            for h in range(store.positions.shape[1]):
                assert prompt <= set(store.positions[b, h].tolist())


@pytest.mark.parametrize(("budget", "protect_prompt"), [(12, True), (12, False), (0.3, False)])
def test_batch_rows_scored_independently(qwen2, left_padded_batch, budget, protect_prompt):
    """Without prompt protection (or with per-row ratio budgets) rows fill their buffers at different
    steps: each row compresses on its own schedule, as it would alone."""
    ids, mask = left_padded_batch
    assert_rows_independent(
        qwen2,
        lambda: SnapKVPolicy(buffer=4),
        ids,
        mask,
        30,
        budget=budget,
        sink=1,
        window=2,
        protect_prompt=protect_prompt,
    )


def test_budget_above_sequence_is_plain_generation(family, make_model, left_padded_batch):
    ids, mask = left_padded_batch
    assert_no_eviction_is_identity(
        make_model(family), lambda: SnapKVPolicy(buffer=4), ids, mask, 24, budget=10_000
    )


def test_combined_mode_with_head_mask(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    assert_combined_mode(qwen2, SnapKVPolicy(buffer=4), ids, mask, 30, budget=12, window=2)


def test_kwargs_and_defaults(qwen2):
    cache = make_cache(
        qwen2, CompressionConfig(policy="snapkv", policy_kwargs={"window": 32, "pooling": "avg"})
    )
    assert (cache.policy.window, cache.policy.observe_queries, cache.policy.pooling) == (32, 32, "avg")
    assert cache.settings.budget == 1024
    default = get_policy("snapkv")
    assert (default.window, default.kernel, default.pooling, default.group_pool, default.buffer) == (
        8,
        7,
        "max",
        "max",
        128,
    )
    with pytest.raises(ValueError, match="group_pool"):
        get_policy("snapkv", group_pool="sum")
