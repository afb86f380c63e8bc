"""H2O: accumulated attention vs plain references, heavy-hitter + recent selection, budgets, batching."""

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
from rlkv.policies.h2o import ACCUMULATED, H2OPolicy


class RecordingH2O(H2OPolicy):
    """H2O that also records, for every forward, the keys present and the new queries (to replay
    the accumulation in a reference), and a snapshot of every selection."""

    observe_queries = 4096  # every query of the sequence (tiny tests only)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.forwards, self.selections = [], []

    def on_attention(self, store, probs):
        q_len = probs.shape[3]
        self.forwards.append(
            {
                "layer": store.layer_idx,
                "keys": store.keys.clone(),
                "positions": store.positions.clone(),
                "queries": store.queries[:, :, :, -q_len:].clone(),
                "query_positions": store.query_positions[-q_len:].clone(),
                "query_valid": store.query_valid()[:, -q_len:].clone(),
            }
        )
        super().on_attention(store, probs)

    def select(self, store):
        snapshot = {
            **store_snapshot(store),
            "accumulated": store.slot_buffer(ACCUMULATED).clone(),
            "num_forwards": sum(f["layer"] == store.layer_idx for f in self.forwards),
        }
        keep = super().select(store)
        snapshot["keep"] = keep.clone()
        self.selections.append(snapshot)
        return keep


def replay_accumulation(forwards, layer: int) -> dict[tuple[int, int, int], float]:
    """Reference H2O score, looped: for every real query so far, softmax over the keys present at
    that step (causal), summed over the query heads of the KV head; keyed by (row, head, position)."""
    acc: dict[tuple[int, int, int], float] = {}
    for fw in (f for f in forwards if f["layer"] == layer):
        keys, positions, queries = fw["keys"].double(), fw["positions"], fw["queries"].double()
        batch, heads, _, dim = keys.shape
        for b in range(batch):
            for h in range(heads):
                for n, q_pos in enumerate(fw["query_positions"].tolist()):
                    if not fw["query_valid"][b, n]:
                        continue
                    slots = [k for k in range(keys.shape[2]) if 0 <= positions[b, h, k] <= q_pos]
                    for g in range(queries.shape[2]):
                        logits = torch.stack(
                            [queries[b, h, g, n] @ keys[b, h, k] / math.sqrt(dim) for k in slots]
                        )
                        for k, p in zip(slots, torch.softmax(logits, 0).tolist()):
                            key = (b, h, int(positions[b, h, k]))
                            acc[key] = acc.get(key, 0.0) + p
    return acc


@pytest.fixture
def qwen2(make_model):
    return make_model("qwen2")


def test_accumulated_attention_equals_the_models_attention(qwen2, left_padded_batch):
    """Without eviction, a slot's score = the attention its key got from every real query (eager
    attention of the whole sequence), summed over the query heads of its group."""
    ids, mask = left_padded_batch
    tokens, cache = generate_with(qwen2, H2OPolicy(), ids, mask, 12, budget=10_000)
    full_ids = torch.cat([ids, tokens[:, :-1]], dim=1)  # the last sampled token is never fed back
    full_mask = torch.cat([mask, torch.ones_like(tokens[:, :-1])], dim=1)
    qwen2.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = qwen2(input_ids=full_ids, attention_mask=full_mask, output_attentions=True).attentions
    groups = qwen2.config.num_attention_heads // qwen2.config.num_key_value_heads
    for layer, attn in zip(cache.layers, attentions):
        real_queries = full_mask.bool()[:, None, :, None]
        received = (attn * real_queries).sum(dim=2)  # [B, H_q, T]: attention each key received
        per_kv_head = received.view(attn.shape[0], -1, groups, attn.shape[-1]).sum(dim=2)
        store = layer.store
        positions = store.positions
        expected = per_kv_head.gather(2, positions.clamp(min=0)).masked_fill(positions < 0, 0.0)
        torch.testing.assert_close(store.slot_buffer(ACCUMULATED), expected, atol=1e-5, rtol=1e-5)


def test_scores_and_selection_under_eviction(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    policy = RecordingH2O(recent_ratio=0.25)
    budget, window = 16, 2
    _, cache = generate_with(qwen2, policy, ids, mask, 30, budget=budget, window=window, sink=1)
    assert len(policy.selections) > 10
    for layer in range(len(cache.layers)):
        seen = [s for s in policy.selections if s["layer"] == layer]
        # replay every forward of this layer up to its last selection
        last = seen[-1]
        forwards = [f for f in policy.forwards if f["layer"] == layer][: last["num_forwards"]]
        reference = replay_accumulation(forwards, layer)
        positions = last["positions"]
        batch, heads, slots = positions.shape
        for b in range(batch):
            for h in range(heads):
                for k in range(slots):
                    if positions[b, h, k] >= 0:
                        expected = reference[(b, h, int(positions[b, h, k]))]
                        assert abs(float(last["accumulated"][b, h, k]) - expected) < 1e-5
        for s in seen:
            recent = max(s["window"], round(0.25 * budget))
            for b in range(batch):
                for h in range(heads):
                    evictable = s["evictable"][b, h]
                    is_recent = evictable & (s["positions"][b, h] >= s["logical_length"] - recent)
                    fixed = is_recent | (s["forced"][b, h] & evictable)
                    candidates = evictable & ~fixed
                    room = budget - int(fixed.sum())
                    heavy = s["accumulated"][b, h].masked_fill(~candidates, -1).topk(room).indices
                    expected = s["forced"][b, h] | is_recent
                    expected[heavy] = True
                    assert s["keep"][b, h].tolist() == expected.tolist()
                    assert int((s["keep"][b, h] & evictable).sum()) == budget
    for layer in cache.layers:
        assert bool((layer.store.num_evictable() <= budget).all())


def test_prompt_kept(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    _, cache = generate_with(qwen2, H2OPolicy(), ids, mask, 30, budget=8, window=2)
    for layer in cache.layers:
        store = layer.store
        assert store.evicted.sum() > 0
        for b in range(ids.shape[0]):
            prompt = set(range(int(store.row_start[b]), ids.shape[1]))
            for h in range(store.positions.shape[1]):
                assert prompt <= set(store.positions[b, h].tolist())


@pytest.mark.parametrize(("budget", "protect_prompt"), [(12, True), (0.3, False)])
def test_batch_rows_scored_independently(qwen2, left_padded_batch, budget, protect_prompt):
    """Fixed budget, and a per-row ratio budget with the prompt evictable (the eval setting)."""
    ids, mask = left_padded_batch
    assert_rows_independent(
        qwen2,
        lambda: H2OPolicy(),
        ids,
        mask,
        30,
        budget=budget,
        sink=2,
        window=4,
        protect_prompt=protect_prompt,
    )


def test_budget_above_sequence_is_plain_generation(family, make_model, left_padded_batch):
    ids, mask = left_padded_batch
    assert_no_eviction_is_identity(make_model(family), lambda: H2OPolicy(), ids, mask, 24, budget=10_000)


def test_combined_mode_with_head_mask(qwen2, left_padded_batch):
    ids, mask = left_padded_batch
    assert_combined_mode(qwen2, H2OPolicy(), ids, mask, 30, budget=12, window=4)


def test_kwargs_and_default_budget(qwen2):
    cache = make_cache(qwen2, CompressionConfig(policy="h2o", policy_kwargs={"recent_ratio": 0.3}))
    assert cache.policy.recent_ratio == 0.3
    assert cache.settings.budget == 0.2  # the paper's 20% cache when the config gives no budget
    with pytest.raises(ValueError, match="recent_ratio"):
        get_policy("h2o", recent_ratio=1.5)


class CountingH2O(H2OPolicy):
    """H2O that records the query count of every `on_attention` call."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.chunks = []

    def on_attention(self, store, probs):
        self.chunks.append(probs.shape[3])
        super().on_attention(store, probs)


def test_prefill_attention_in_query_chunks_equals_one_pass(qwen2, left_padded_batch, monkeypatch):
    """A long prefill never holds Q x K float32 scores at once: chunked, the outputs and scores are the same."""
    import rlkv.cache.attention

    ids, mask = left_padded_batch
    whole = CountingH2O()
    tokens, cache = generate_with(qwen2, whole, ids, mask, 20, budget=12, sink=2, window=4)
    layers, width = len(cache.layers), ids.shape[1]
    assert whole.chunks[:layers] == [width] * layers  # one pass per layer by default
    monkeypatch.setattr(rlkv.cache.attention, "EAGER_CHUNK_ELEMENTS", 1)  # one query per chunk
    chunked = CountingH2O()
    tokens_chunked, cache_chunked = generate_with(qwen2, chunked, ids, mask, 20, budget=12, sink=2, window=4)
    assert chunked.chunks[: layers * width] == [1] * (layers * width)
    assert tokens_chunked.tolist() == tokens.tolist()
    for a, b in zip(cache.layers, cache_chunked.layers):
        assert a.store.positions.equal(b.store.positions)
        torch.testing.assert_close(
            a.store.slot_buffer(ACCUMULATED), b.store.slot_buffer(ACCUMULATED), atol=1e-5, rtol=1e-5
        )
