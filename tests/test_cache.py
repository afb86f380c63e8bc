"""HeadMixedCache: token identity with the plain model, logical positions, real memory, batches, resets."""

import pytest
import torch
from transformers import AttentionInterface, DynamicCache
from transformers.integrations.sdpa_attention import repeat_kv

from rlkv.cache import HeadMixedCache
from rlkv.compat import cache_kwargs
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig, make_cache


def _mixed_mask(model) -> HeadMask:
    """Scores that mark one KV head per layer full at sparsity 0.5 (a different one in each layer)."""
    mask = HeadMask.random(model, seed=0)
    mask.scores = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    return mask


def _plain_generate(model, input_ids, attention_mask, max_new_tokens):
    return model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False
    )


@pytest.mark.cross_path_floats
@pytest.mark.parametrize(
    "compression",
    [
        dict(head_mask="mixed", sparsity=0.0),  # every head full
        dict(head_mask=None, window=10_000),  # every head compressed, budget beyond the sequence
        dict(head_mask="mixed", sparsity=0.5, window=10_000, protect_prompt=False),
    ],
    ids=["sparsity0", "all-compressed-huge-window", "mixed-huge-window"],
)
def test_identical_to_plain_generate(model, left_padded_batch, compression):
    input_ids, attention_mask = left_padded_batch
    expected = _plain_generate(model, input_ids, attention_mask, 24)
    if compression["head_mask"] == "mixed":
        compression["head_mask"] = _mixed_mask(model)
    cache = make_cache(model, CompressionConfig(**compression))
    got = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=24,
        do_sample=False,
        **cache_kwargs(cache),
    )
    assert torch.equal(got, expected)
    assert sum(s["evictions"] for s in cache.stats()) == 0


# --- logical positions: the compressed run equals attention with an explicit keep-mask -----------------

REFERENCE_KEEP: dict[
    int, torch.Tensor
] = {}  # layer -> BoolTensor[H_kv, T]: key positions each KV head may see


def _keep_mask_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """Eager attention over the FULL history, restricted per KV head to the positions in REFERENCE_KEEP."""
    keys, values = repeat_kv(key, module.num_key_value_groups), repeat_kv(value, module.num_key_value_groups)
    logits = torch.matmul(query, keys.transpose(2, 3)) * scaling
    q_len, k_len = query.shape[2], key.shape[2]
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    allowed = causal[None, None].expand(1, query.shape[1], q_len, k_len)
    keep = REFERENCE_KEEP.get(module.layer_idx)
    if keep is not None:
        per_query_head = keep.repeat_interleave(module.num_key_value_groups, dim=0)  # [H_q, T]
        allowed = allowed & per_query_head[None, :, None, :]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
    return torch.matmul(probs, values).transpose(1, 2).contiguous(), None


AttentionInterface.register("test_keep_mask", _keep_mask_attention)


def _kept_positions(cache: HeadMixedCache, layer_idx: int, num_kv: int, length: int) -> torch.Tensor:
    """BoolTensor[H_kv, length] of the positions row 0 of `layer_idx` holds (full heads: everything)."""
    layer = cache.layers[layer_idx]
    keep = torch.zeros(num_kv, length, dtype=torch.bool)
    keep[layer.full_idx] = True
    for slot_head, kv_head in enumerate(layer.comp_idx.tolist()):
        pos = layer.store.positions[0, slot_head]
        keep[kv_head, pos[pos >= 0]] = True
    return keep


@pytest.mark.cross_path_floats
@pytest.mark.parametrize(
    "family, protect_prompt", [("llama", False), ("qwen2", False), ("qwen3", False), ("llama", True)]
)
def test_compressed_run_equals_explicit_keep_mask_reference(family, make_model, tokenizer, protect_prompt):
    sink, window, steps = 4, 16, 200
    model = make_model(family)
    reference = make_model(family, attn_implementation="test_keep_mask")
    ids = tokenizer("solve the following math problem efficiently and clearly", return_tensors="pt")[
        "input_ids"
    ]
    prompt_len = ids.shape[1]
    config = CompressionConfig(
        head_mask=_mixed_mask(model), sparsity=0.5, sink=sink, window=window, protect_prompt=protect_prompt
    )
    cache = make_cache(model, config)
    ref_cache = DynamicCache(config=reference.config)
    num_kv = model.config.num_key_value_heads
    REFERENCE_KEEP.clear()
    tokens, ref_tokens, max_diff = ids, ids, 0.0
    with torch.no_grad():
        for step in range(steps):
            length = cache.get_seq_length()
            if step:  # prefill attends causally over the whole prompt; decode steps use the kept positions
                for layer_idx in range(model.config.num_hidden_layers):
                    keep = _kept_positions(cache, layer_idx, num_kv, length + 1)
                    keep[:, length] = True  # the current token attends to itself
                    REFERENCE_KEEP[layer_idx] = keep
                # the cache kept exactly the streaming set: sink + window (+ prompt when protected)
                expected = set(range(sink)) | set(range(max(0, length - window), length))
                if protect_prompt:
                    expected |= set(range(prompt_len))
                comp_head = cache.layers[0].comp_idx[0]
                got = set(torch.nonzero(REFERENCE_KEEP[0][comp_head, :length]).flatten().tolist())
                assert got == expected
            new = tokens[:, length:]
            logits = model(input_ids=new, **cache_kwargs(cache)).logits[:, -1]
            ref_logits = reference(input_ids=ref_tokens[:, length:], **cache_kwargs(ref_cache)).logits[:, -1]
            max_diff = max(max_diff, float((logits - ref_logits).abs().max()))
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
            ref_tokens = torch.cat([ref_tokens, ref_logits.argmax(-1, keepdim=True)], dim=1)
    REFERENCE_KEEP.clear()
    assert torch.equal(tokens, ref_tokens)
    assert max_diff < 1e-4
    assert cache.stats()[0]["evictions"] > 0
    assert cache.get_seq_length() == prompt_len + steps - 1  # logical length, not the kept count


# --- memory: resident bytes from tensor storage equal the analytic formula ----------------------------


def _reachable_storage_bytes(obj) -> int:
    """Sum of distinct tensor storages reachable from `obj`'s attributes (independent of the cache's bookkeeping)."""
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [obj]
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, torch.Tensor):
            storages[item.untyped_storage().data_ptr()] = item.untyped_storage().nbytes()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif hasattr(item, "__dict__") and not isinstance(item, (type, torch.nn.Module)):
            stack.extend(vars(item).values())
    return sum(storages.values())


def test_resident_bytes_match_formula_and_tensors_shrink(make_model, left_padded_batch):
    sink, window, new_tokens = 4, 8, 40
    model = make_model("llama")
    input_ids, attention_mask = left_padded_batch
    config = CompressionConfig(
        head_mask=_mixed_mask(model), sparsity=0.5, sink=sink, window=window, protect_prompt=False
    )
    cache = make_cache(model, config)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=None,  # run the full length in every row
        **cache_kwargs(cache),
    )
    batch, width = input_ids.shape
    length = width + new_tokens - 1  # the last sampled token is never fed back
    cfg = model.config
    head_dim, fp32, int64, int32 = cfg.head_dim, 4, 8, 4
    full_heads, comp_heads = 1, 1  # per layer, from _mixed_mask at sparsity 0.5
    kept = sink + window  # every row has more real tokens than sink + window by now
    per_layer = (
        2 * batch * full_heads * length * head_dim * fp32
    )  # full heads: keys + values, padding included
    per_layer += batch * comp_heads * kept * (2 * head_dim * fp32 + int32)  # kept keys + values + positions
    # bookkeeping: row starts + eviction counters (int64 [B]), the full/compressed KV and query head indices
    # per layer, plus the [L, H_kv] bool layout
    per_layer += 2 * batch * int64 + (cfg.num_key_value_heads + cfg.num_attention_heads) * int64
    expected = cfg.num_hidden_layers * per_layer + cfg.num_hidden_layers * cfg.num_key_value_heads
    assert cache.resident_bytes() == expected
    assert _reachable_storage_bytes(cache) == expected
    for layer in cache.layers:
        assert layer.store.keys.untyped_storage().nbytes() == batch * comp_heads * kept * head_dim * fp32
        assert bool((layer.store.positions >= 0).all())  # no padding slot was kept
        assert layer.store.positions.dtype == torch.int32  # counted as 4 bytes a slot above
    full = cfg.num_hidden_layers * 2 * batch * cfg.num_key_value_heads * length * head_dim * fp32
    assert cache.full_resident_bytes() == full


def test_padding_never_takes_budget(make_model, left_padded_batch):
    sink, window = 2, 6
    model = make_model("qwen2")
    input_ids, attention_mask = left_padded_batch
    config = CompressionConfig(head_mask=None, sink=sink, window=window, protect_prompt=True)
    cache = make_cache(model, config)
    model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=12,
        do_sample=False,
        **cache_kwargs(cache),
    )
    prompt_real = attention_mask.sum(1)
    pads = attention_mask.shape[1] - prompt_real
    for layer in cache.layers:
        positions = layer.store.positions
        for row in range(input_ids.shape[0]):
            kept = positions[row][positions[row] >= 0]
            assert bool((kept >= pads[row]).all()), "a padding column was stored"
            # protected prompt + the last `window` generated tokens, nothing else
            assert kept.shape[-1] == layer.store.keys.shape[1] * (int(prompt_real[row]) + window)


def test_second_generate_with_same_cache_starts_clean(make_model, tokenizer):
    model = make_model("qwen3")
    config = CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.5, sink=2, window=6)
    first = tokenizer(["1 + 2 = 3. 2 * 3 = 6. therefore the final answer is"], return_tensors="pt")
    second = tokenizer(["wait"], return_tensors="pt")
    reused = make_cache(model, config)
    model.generate(**first, max_new_tokens=20, do_sample=False, **cache_kwargs(reused))
    got = model.generate(**second, max_new_tokens=20, do_sample=False, **cache_kwargs(reused))
    fresh = model.generate(
        **second, max_new_tokens=20, do_sample=False, **cache_kwargs(make_cache(model, config))
    )
    assert torch.equal(got, fresh)
    assert reused.stats() == make_cache_stats_after(model, config, second)


def make_cache_stats_after(model, config, enc):
    cache = make_cache(model, config)
    model.generate(**enc, max_new_tokens=20, do_sample=False, **cache_kwargs(cache))
    return cache.stats()


def test_unsupported_cache_operations_fail_clearly(make_model, tokenizer):
    model = make_model("llama")
    cache = make_cache(model, CompressionConfig(head_mask=None))
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(
            **tokenizer(["wait"], return_tensors="pt"), max_new_tokens=4, num_beams=2, **cache_kwargs(cache)
        )
    cache = make_cache(model, CompressionConfig(head_mask=None), batch_size=1)
    enc = tokenizer(["wait", "solve"], return_tensors="pt", padding=True)
    with pytest.raises(ValueError, match="batch_size=1"):
        model.generate(**enc, max_new_tokens=2, **cache_kwargs(cache))


def test_chunked_prefill_protects_the_whole_prompt(make_model, tokenizer):
    model = make_model("llama")
    enc = tokenizer(
        ["1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is boxed"], return_tensors="pt"
    )
    config = CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.5, sink=2, window=8)
    whole = model.generate(
        **enc, max_new_tokens=20, do_sample=False, **cache_kwargs(make_cache(model, config))
    )
    chunked_cache = make_cache(model, config)
    chunked = model.generate(
        **enc, max_new_tokens=20, do_sample=False, **cache_kwargs(chunked_cache), prefill_chunk_size=8
    )
    assert torch.equal(whole, chunked)
    assert chunked_cache.layers[0].store.prompt_length == enc["input_ids"].shape[1]


def test_make_cache_refuses_a_gated_model(make_model):
    from rlkv import attach_gates

    model = make_model("llama")
    attach_gates(model)
    with pytest.raises(ValueError, match="detach_gates"):
        make_cache(model, CompressionConfig(head_mask=None))


def test_mistral_update_object_is_safe(make_model, left_padded_batch):
    # Mistral's attention also passes update()'s return straight to the attention function
    model = make_model("mistral")
    input_ids, attention_mask = left_padded_batch
    expected = _plain_generate(model, input_ids, attention_mask, 16)
    cache = make_cache(model, CompressionConfig(head_mask=None, window=10_000))
    got = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=16,
        do_sample=False,
        **cache_kwargs(cache),
    )
    assert torch.equal(got, expected)


# --- a new request on a non-empty cache fails loudly (issue 19.4) ----------------------------------


def _no_generate_reset(monkeypatch):
    """Simulate a transformers that no longer sets `cache._is_user_defined` at the start of `generate`."""
    monkeypatch.setattr(HeadMixedCache, "_is_user_defined", property(lambda self: True, lambda self, v: None))


def test_new_prefill_on_a_used_cache_is_refused_and_reset_clears_it(make_model, tokenizer):
    from rlkv.cache import StaleCacheError

    model = make_model("llama")
    config = CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.5, sink=2, window=6)
    cache = make_cache(model, config)
    ids = tokenizer(["1 + 2 = 3. 2 * 3 = 6. therefore"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        model(input_ids=ids[:, :6], **cache_kwargs(cache))  # chunked prefill: two multi-token chunks
        model(input_ids=ids[:, 6:], **cache_kwargs(cache))
        model(input_ids=ids[:, -1:], **cache_kwargs(cache))  # a decode step
        with pytest.raises(StaleCacheError, match="cache.reset\\(\\)"):
            model(input_ids=ids, **cache_kwargs(cache))  # the next request's prefill
        cache.reset()
        again = model(input_ids=ids, **cache_kwargs(cache)).logits
        fresh = model(input_ids=ids, **cache_kwargs(make_cache(model, config))).logits
    assert torch.equal(again, fresh)


def test_generate_without_transformers_reset_fails_loudly(make_model, tokenizer, monkeypatch):
    from rlkv.cache import StaleCacheError

    _no_generate_reset(monkeypatch)
    model = make_model("qwen3")
    cache = make_cache(model, CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.5, sink=2, window=6))
    enc = tokenizer(["1 + 2 = 3. 2 * 3 = 6. therefore the final answer is"], return_tensors="pt")
    model.generate(**enc, max_new_tokens=8, do_sample=False, **cache_kwargs(cache))
    longer = tokenizer(["1 + 2 = 3. 2 * 3 = 6. therefore the final answer is 6, so 6 + 1 = 7 and"])
    with pytest.raises(StaleCacheError):
        model.generate(
            input_ids=torch.tensor(longer["input_ids"]),
            max_new_tokens=8,
            do_sample=False,
            **cache_kwargs(cache),
        )


def test_inference_generate_resets_its_cache_itself(make_model, tokenizer, monkeypatch):
    from rlkv.inference import generate

    model = make_model("qwen3")
    config = CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.5, sink=2, window=6)
    prompts = ["1 + 2 = 3. 2 * 3 = 6. therefore the final answer is", "wait", "solve 4 + 5 step by step"]
    alone = [generate(model, tokenizer, [p], 12, compression=config, progress=False)[0] for p in prompts]
    _no_generate_reset(monkeypatch)
    batched = generate(model, tokenizer, prompts, 12, compression=config, batch_size=1, progress=False)
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [o.cache_stats for o in batched] == [o.cache_stats for o in alone]


def test_positions_are_int32_until_they_no_longer_fit():
    from rlkv.cache.store import position_dtype

    assert position_dtype(2**31) == torch.int32  # positions 0 .. 2**31 - 1
    assert position_dtype(2**31 + 1) == torch.int64
