"""The policy interface: registry, what a policy observes, and how its selections are applied."""

import pytest
import torch

from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies import (
    CompressionPolicy,
    UnknownPolicyError,
    available,
    get_policy,
    keep_top_scores,
    register_policy,
)

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)


@register_policy("test_recorder")
class RecorderPolicy(CompressionPolicy):
    """Keeps everything and records all it is shown."""

    observe_queries = 3
    observe_attention = True
    observe_tokens = True
    observe_hidden_states = True

    def __init__(self):
        self.tokens, self.token_positions, self.hidden, self.hidden_positions = [], [], [], []
        self.probs: dict[int, list[torch.Tensor]] = {}
        self.stores = {}

    def reset(self):
        self.__init__()

    def on_tokens(self, token_ids, positions):
        self.tokens.append(token_ids.clone())
        self.token_positions.append(positions.clone())

    def on_hidden_states(self, hidden_states, positions):
        self.hidden.append(hidden_states.clone())
        self.hidden_positions.append(positions.clone())

    def on_attention(self, store, probs):
        self.probs.setdefault(store.layer_idx, []).append(probs.clone())
        self.stores[store.layer_idx] = store

    def should_compress(self, store):
        return False


@register_policy("test_newest")
class NewestPolicy(CompressionPolicy):
    """Keeps the newest evictable tokens within the budget (scores = positions), selecting per layer."""

    def select(self, store):
        keep = keep_top_scores(store, store.positions[:, 0].float())  # [B, K] scores shared by the heads
        return keep[:, 0]  # per-layer selection: [B, K]


@register_policy("test_stamped")
class StampedPolicy(CompressionPolicy):
    """Evicts pseudo-randomly; a slot buffer stamps each slot with its position to check alignment."""

    observe_attention = True

    def on_attention(self, store, probs):
        stamp = store.slot_buffer("stamp", fill=-1.0)
        fresh = stamp < 0
        stamp[fresh] = store.positions[fresh].float()

    def select(self, store):
        scores = ((store.positions * 7919) % 101).float()  # deterministic, unordered
        return keep_top_scores(store, scores)


def test_registry_lists_finds_and_rejects():
    assert {"streaming", "full", "test_recorder"} <= set(available())
    assert isinstance(get_policy("streaming"), CompressionPolicy)
    with pytest.raises(UnknownPolicyError, match="unknown policy 'nope'; available policies: .*streaming"):
        get_policy("nope")
    with pytest.raises(TypeError, match="CompressionPolicy subclass"):
        register_policy("not_a_policy")(object)
    with pytest.raises(ValueError, match="already registered"):

        @register_policy("streaming")
        class Other(CompressionPolicy):
            pass


def test_policy_observes_tokens_hidden_states_queries_and_attention(make_model, tokenizer):
    model = make_model("llama")
    eager = make_model("llama", attn_implementation="eager")
    enc = tokenizer(["solve the following math problem"], return_tensors="pt")
    cache = make_cache(model, CompressionConfig(head_mask=None, policy="test_recorder"))
    policy = cache.policy
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, eos_token_id=None, **cache_kwargs(cache))
    fed = out[:, :-1]  # every token the model consumed
    length = fed.shape[1]

    assert torch.equal(torch.cat(policy.tokens, dim=1), fed)
    assert torch.equal(torch.cat(policy.token_positions), torch.arange(length))
    assert torch.equal(torch.cat(policy.hidden_positions), torch.arange(length))
    with torch.no_grad():
        reference = eager(input_ids=fed, output_attentions=True)
        final_hidden = eager.model(input_ids=fed).last_hidden_state
    torch.testing.assert_close(torch.cat(policy.hidden, dim=1), final_hidden, atol=1e-5, rtol=1e-5)

    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer_idx, probs in policy.probs.items():
        store = policy.stores[layer_idx]
        # nothing evicted: slot k holds position k, and the eager model's attention rows match
        assert torch.equal(store.positions[0, 0], torch.arange(length))
        last = probs[-1][:, :, :, -1, :]  # [B, H_c, G, K]
        expected = reference.attentions[layer_idx][:, :, -1, :].reshape(1, -1, groups, length)
        torch.testing.assert_close(last, expected, atol=1e-5, rtol=1e-5)
        assert probs[0].shape[-2:] == (enc["input_ids"].shape[1],) * 2  # prefill: Q x K over the prompt
        # the remembered queries are the last three, and they produce those probabilities
        assert torch.equal(store.query_positions, torch.arange(length - 3, length))
        assert store.queries.shape == (1, store.keys.shape[1], groups, 3, model.config.head_dim)
        logits = (
            torch.einsum("bhgd,bhkd->bhgk", store.queries[:, :, :, -1], store.keys)
            * model.config.head_dim**-0.5
        )
        torch.testing.assert_close(torch.softmax(logits, -1), last, atol=1e-5, rtol=1e-5)


def test_per_layer_selection_and_budget(make_model, tokenizer):
    budget = 12
    model = make_model("qwen3")
    enc = tokenizer(["wait", "solve the following math problem"], return_tensors="pt", padding=True)
    config = CompressionConfig(
        head_mask=None, policy="test_newest", budget=budget, sink=0, window=4, protect_prompt=False
    )
    cache = make_cache(model, config)
    model.generate(**enc, max_new_tokens=30, do_sample=False, eos_token_id=None, **cache_kwargs(cache))
    length = cache.get_seq_length()
    for layer in cache.layers:
        positions = layer.store.positions
        for row in range(2):
            for head in range(positions.shape[1]):
                assert positions[row, head].tolist() == list(range(length - budget, length))


def test_slot_buffers_follow_evictions_and_forced_set_is_kept(make_model, tokenizer):
    budget, sink, window = 10, 2, 3
    model = make_model("qwen2")
    enc = tokenizer(["1 + 2 = 3. 2 * 3 = 6.", "wait"], return_tensors="pt", padding=True)
    prompt_len = enc["input_ids"].shape[1]
    config = CompressionConfig(head_mask=None, policy="test_stamped", budget=budget, sink=sink, window=window)
    cache = make_cache(model, config)
    model.generate(**enc, max_new_tokens=40, do_sample=False, eos_token_id=None, **cache_kwargs(cache))
    length = cache.get_seq_length()
    pads = (enc["attention_mask"] == 0).sum(1)
    for layer in cache.layers:
        store = layer.store
        valid = store.valid()
        assert torch.equal(store.slot_buffer("stamp")[valid], store.positions[valid].float())
        for row in range(2):
            for head in range(valid.shape[1]):
                kept = set(store.positions[row, head][valid[row, head]].tolist())
                prompt = set(range(int(pads[row]), prompt_len))  # protected, padding excluded
                assert prompt | set(range(length - window, length)) <= kept
                assert len(kept - prompt) == budget  # the evictable tokens kept: exactly the budget
        assert int(store.evicted.sum()) > 0


def test_ratio_budget_follows_each_rows_length(make_model, tokenizer):
    ratio, window = 0.25, 4
    model = make_model("llama")
    enc = tokenizer(["wait", "1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9."], return_tensors="pt", padding=True)
    config = CompressionConfig(
        head_mask=None, policy="test_newest", budget=ratio, sink=0, window=window, protect_prompt=False
    )
    cache = make_cache(model, config)
    model.generate(**enc, max_new_tokens=30, do_sample=False, eos_token_id=None, **cache_kwargs(cache))
    length = cache.get_seq_length()
    real = enc["attention_mask"].sum(1) + length - enc["input_ids"].shape[1]  # real tokens seen per row
    for layer in cache.layers:
        valid = layer.store.valid()
        for row in range(2):
            budget = round(ratio * int(real[row])) + window
            assert valid[row].sum(-1).tolist() == [budget] * valid.shape[1]
            newest = list(range(length - budget, length))
            assert layer.store.positions[row, 0][valid[row, 0]].tolist() == newest
