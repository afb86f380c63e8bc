"""Shared property checks for the attention-based eviction policy tests (RPC, H2O, SnapKV).

Not a test module: helpers that run a tiny model through a `HeadMixedCache` with a given policy
instance and assert the properties every policy must have (batch rows independent, identity with
plain `generate` when nothing is evicted, combined mode with a head mask).
"""

from __future__ import annotations

import torch

from rlkv.cache import HeadMixedCache, register_attention
from rlkv.compat import cache_kwargs
from rlkv.head_mask import HeadMask
from rlkv.policies.base import CompressionPolicy


def generate_with(
    model,
    policy: CompressionPolicy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    new_tokens: int,
    **cache_kwargs,
) -> tuple[torch.Tensor, HeadMixedCache]:
    """Greedy-generate exactly `new_tokens` tokens through a `HeadMixedCache`: (tokens [B, new], cache)."""
    tokens, _, cache = generate_with_logits(
        model, policy, input_ids, attention_mask, new_tokens, **cache_kwargs
    )
    return tokens, cache


def generate_with_logits(
    model,
    policy: CompressionPolicy,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    new_tokens: int,
    *,
    full_heads: torch.Tensor | None = None,
    sink: int = 0,
    window: int = 0,
    budget: int | float | None = None,
    protect_prompt: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, HeadMixedCache]:
    """`generate_with`, plus the logits of every step: (tokens [B, new], logits [new, B, V], cache)."""
    model.set_attn_implementation(register_attention())
    cache = HeadMixedCache(
        model.config,
        full_heads,
        policy,
        sink=sink,
        window=window,
        budget=budget,
        protect_prompt=protect_prompt,
    )
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        **cache_kwargs(cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
        output_logits=True,
    )
    return out.sequences[:, input_ids.shape[1] :], torch.stack(out.logits), cache


def plain_generate(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int
) -> torch.Tensor:
    """Greedy tokens of the stock model (sdpa, DynamicCache)."""
    model.set_attn_implementation("sdpa")
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[:, input_ids.shape[1] :]


def store_snapshot(store) -> dict:
    """Copies of what a policy sees in `select`: keys, positions, observation queries, masks, budget."""
    return {
        "layer": store.layer_idx,
        "num_generated": store.num_generated,
        "logical_length": store.logical_length,
        "window": store.window,
        "keys": store.keys.clone(),
        "positions": store.positions.clone(),
        "queries": None if store.queries is None else store.queries.clone(),
        "query_positions": None if store.query_positions is None else store.query_positions.clone(),
        "query_valid": None if store.queries is None else store.query_valid().clone(),
        "evictable": store.evictable().clone(),
        "forced": store.forced_keep().clone(),
        "protected": store.protected().clone(),
        "budget": None if store.budget is None else store.budget.clone(),
    }


def kept_positions(cache: HeadMixedCache, row: int) -> list[list[list[int]]]:
    """Per layer and compressed head: the row's kept positions, relative to its first real token."""
    result = []
    for layer in cache.layers:
        store = layer.store
        start = int(store.row_start[row])
        heads = []
        for head in range(store.positions.shape[1]):
            pos = store.positions[row, head]
            heads.append(sorted((pos[pos >= 0] - start).tolist()))
        result.append(heads)
    return result


def assert_rows_independent(
    model, make_policy, input_ids, attention_mask, new_tokens: int, **cache_kwargs
) -> None:
    """A left-padded batch gives every row the tokens and kept positions it gets alone."""
    batch_tokens, batch_cache = generate_with(
        model, make_policy(), input_ids, attention_mask, new_tokens, **cache_kwargs
    )
    evicted = 0
    for row in range(input_ids.shape[0]):
        real = attention_mask[row].bool()
        alone_ids = input_ids[row : row + 1, real]
        alone_tokens, alone_cache = generate_with(
            model, make_policy(), alone_ids, torch.ones_like(alone_ids), new_tokens, **cache_kwargs
        )
        assert batch_tokens[row].tolist() == alone_tokens[0].tolist(), (
            f"row {row}: tokens differ from running alone"
        )
        assert kept_positions(batch_cache, row) == kept_positions(alone_cache, 0), (
            f"row {row}: kept positions differ"
        )
        evicted += alone_cache.stats()[0]["evictions"]
    assert evicted > 0, "the check is vacuous: nothing was evicted"


def assert_no_eviction_is_identity(
    model, make_policy, input_ids, attention_mask, new_tokens: int, **cache_kwargs
):
    """With a budget above the sequence, tokens equal plain `model.generate` and nothing is evicted."""
    expected = plain_generate(model, input_ids, attention_mask, new_tokens)
    tokens, cache = generate_with(model, make_policy(), input_ids, attention_mask, new_tokens, **cache_kwargs)
    assert tokens.tolist() == expected.tolist()
    assert all(row["evictions"] == 0 for row in cache.stats())


def expected_resident_bytes(cache: HeadMixedCache) -> int:
    """Analytic bytes of a head-mixed cache from its shapes: full heads hold every column (padding
    included), compressed heads their kept slots (K, V fp32; int32 positions), plus the cached
    queries, the policy's per-slot buffers (fp32) and the O(B + H) bookkeeping (int64 row starts and
    eviction counters, KV and query head indices per layer; the bool [L, H_kv] layout)."""
    total = cache.full_heads.numel()
    for layer in cache.layers:
        batch = int(layer.row_start.numel())
        total += batch * 8 + layer.num_kv_heads * (1 + layer.num_groups) * 8
        num_full = int(layer.full_idx.numel())
        if num_full:
            _, _, length, dim = layer.keys.shape
            assert length == layer.logical_length
            total += 2 * batch * num_full * length * dim * layer.keys.element_size()
        store = layer.store
        if store is None:
            continue
        _, heads, slots, dim = store.keys.shape
        total += batch * 8  # eviction counter per row
        total += batch * heads * slots * (2 * dim * store.keys.element_size() + 4)  # K, V, int32 pos
        total += batch * heads * slots * 4 * len(store._slot_buffers)
        if store.queries is not None:  # a ring of observe_queries slots (rlkv/cache/store.py)
            num_q = layer.settings.policy.observe_queries
            total += batch * heads * layer.num_groups * num_q * dim * store.queries.element_size()
    return total


def assert_combined_mode(
    model, policy: CompressionPolicy, input_ids, attention_mask, new_tokens: int, **cache_kwargs
):
    """With a head mask at sparsity 0.5 (one full head per layer): full heads keep every token, the
    policy bounds the others, and the resident bytes (read from storage) equal the analytic formula."""
    full_heads = HeadMask.random(model, seed=3).full_heads(0.5, min_full_per_layer=1)
    assert full_heads.sum(1).tolist() == [1] * full_heads.shape[0]
    _, cache = generate_with(
        model, policy, input_ids, attention_mask, new_tokens, full_heads=full_heads, **cache_kwargs
    )
    for layer in cache.layers:
        if layer.full_idx.numel():
            assert layer.keys.shape[2] == layer.logical_length  # every column kept
    stores = [layer.store for layer in cache.layers if layer.store is not None]
    assert stores and all(store.evicted.sum() > 0 for store in stores)
    assert cache.resident_bytes() == expected_resident_bytes(cache)
    return cache
