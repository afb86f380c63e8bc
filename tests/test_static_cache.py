"""StaticHeadMixedCache: the dynamic cache's results with static shapes, fixed addresses, no host sync, compiled."""

import pytest
import torch

from rlkv.cache.static import StaticHeadMixedCache
from rlkv.cache.static.budget import StaticCacheError, unpadded_run
from rlkv.compat import cache_kwargs
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig, generate, make_cache
from rlkv.policies.helpers.steering import SteeringVector
from rlkv.testing import HostSyncCounter, graph_counting_compile, tiny_model, tiny_tokenizer

SINK, WINDOW = 2, 4
STEPS = 30


def _mixed_mask(model) -> HeadMask:
    """One KV head per layer full at sparsity 0.5, a different one in each layer."""
    mask = HeadMask.random(model, seed=0)
    mask.scores = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    return mask


CASES = {
    "streaming": dict(sparsity=0.5),
    "streaming-unprotected": dict(sparsity=0.5, protect_prompt=False),
    "streaming-all-heads": dict(mask=False, protect_prompt=False),
    "rkv": dict(sparsity=0.5, policy="rkv", budget=10, policy_kwargs=dict(buffer=4)),
    "snapkv": dict(mask=False, policy="snapkv", budget=10, policy_kwargs=dict(buffer=3)),
    "knorm": dict(mask=False, policy="knorm", budget=10, policy_kwargs=dict(buffer=2)),
    "sink-recent": dict(mask=False, policy="sink-recent", budget=8),
    # SkipKV: R-KV's schedule; token ids and final hidden states observed in the host bookkeeping
    "skipkv": dict(
        sparsity=0.5,
        policy="skipkv",
        budget=10,
        policy_kwargs=dict(buffer=4, tokenizer=tiny_tokenizer(), tau=0.6),
    ),
    # H2O: accumulated attention in per-slot buffers that follow the slots, one eviction per step
    "h2o": dict(sparsity=0.5, policy="h2o", budget=10),
    # RPC: compactions at 8, 14, 20, ... generated tokens (interval + selector window, then every interval)
    "rpc": dict(
        sparsity=0.5, policy="rpc", budget=10, policy_kwargs=dict(interval=6, selector_window=2, kernel=3)
    ),
    # RPC's first compaction keeps all 6 (below the budget), the second cuts 10 to the budget of 8
    "rpc-below-budget": dict(
        mask=False, policy="rpc", budget=8, policy_kwargs=dict(interval=4, selector_window=2)
    ),
    # RPC's own target (no budget): P / c = 2 more kept per cycle, + R (6, 8, 10 at 12, 20, 28 generated)
    "rpc-own-target": dict(
        sparsity=0.5, policy="rpc", policy_kwargs=dict(interval=8, selector_window=4, ratio=4, kernel=3)
    ),
    # ratio budgets (RLKV's dynamic budget): each row's budget follows its own real length, so rows of
    # different prompt lengths compact to different counts (H2O and KNorm default to 0.2)
    "h2o-ratio": dict(sparsity=0.5, policy="h2o", budget=0.2),
    "knorm-ratio": dict(mask=False, policy="knorm", budget=0.2, policy_kwargs=dict(buffer=2)),
    # R-KV cuts only the rows whose buffer is full: the others keep every slot
    "rkv-ratio": dict(sparsity=0.5, policy="rkv", budget=0.25, policy_kwargs=dict(buffer=3)),
    "rpc-ratio": dict(
        sparsity=0.5, policy="rpc", budget=0.3, policy_kwargs=dict(interval=6, selector_window=2, kernel=3)
    ),
    # unprotected prompts: the prompt counts against the budget, so long rows compact before the first
    # decode step and every row on its own schedule (the eval's matched baselines: a ratio, unprotected)
    "rkv-unprotected": dict(
        sparsity=0.5, policy="rkv", budget=10, protect_prompt=False, policy_kwargs=dict(buffer=4)
    ),
    "knorm-ratio-unprotected": dict(
        mask=False, policy="knorm", budget=0.2, protect_prompt=False, policy_kwargs=dict(buffer=2)
    ),
    "sink-recent-ratio-unprotected": dict(mask=False, policy="sink-recent", budget=0.3, protect_prompt=False),
    # H2O over an unprotected prompt: the prompt's own attention scores it from the prefill on
    "h2o-unprotected": dict(sparsity=0.5, policy="h2o", budget=10, protect_prompt=False),
    "h2o-ratio-unprotected": dict(mask=False, policy="h2o", budget=0.25, protect_prompt=False),
    # random eviction: priorities hashed from each slot's position in its row, the prompt ranked first
    "random": dict(sparsity=0.5, policy="random", budget=10),
    "random-ratio-unprotected": dict(mask=False, policy="random", budget=0.25, protect_prompt=False),
    "rpc-ratio-unprotected": dict(
        sparsity=0.5,
        policy="rpc",
        budget=0.3,
        protect_prompt=False,
        policy_kwargs=dict(interval=6, selector_window=2, kernel=3),
    ),
}


def _config(model, case: str) -> CompressionConfig:
    kwargs = dict(CASES[case])
    head_mask = _mixed_mask(model) if kwargs.pop("mask", True) else None
    return CompressionConfig(head_mask=head_mask, sink=SINK, window=WINDOW, **kwargs)


def greedy_generate(model, batch, cache, steps=STEPS, **kwargs):
    """Greedy `generate` of `steps` tokens for a (input_ids, attention_mask) batch on `cache` (None: dynamic)."""
    input_ids, attention_mask = batch
    return model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=steps,
        do_sample=False,
        **cache_kwargs(cache),
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def _position_sets(positions: torch.Tensor) -> list[list[list[int]]]:
    return [[sorted(p for p in head if p >= 0) for head in row] for row in positions.tolist()]


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("case", list(CASES))
def test_same_tokens_logits_and_kept_positions_as_the_dynamic_cache(left_padded_batch, case):
    model = tiny_model("llama")
    config = _config(model, case)
    dynamic = make_cache(model, config)
    expected = greedy_generate(model, left_padded_batch, dynamic)
    static = make_cache(model, config, static=True, max_cache_len=left_padded_batch[0].shape[1] + STEPS)
    got = greedy_generate(model, left_padded_batch, static)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
    evicted = 0
    for dyn_layer, static_layer in zip(dynamic.layers, static.layers, strict=True):
        if dyn_layer.store is None:
            assert static_layer.kept_positions() is None
            continue
        assert _position_sets(static_layer.kept_positions()) == _position_sets(dyn_layer.store.positions)
        evicted += int(dyn_layer.store.evicted.sum())
    assert evicted > 0  # the case really evicts
    if isinstance(config.budget, float):  # rows of different lengths kept different counts
        assert any(len(set(kept)) > 1 for _, kept in static.layers[0].schedule.events)
    if static.form.kind == "budget" and not config.protect_prompt and config.policy != "rpc":
        assert static.layers[0].schedule.events[0][0] == 0  # long prompts were cut before the first step
    strip = ("resident_bytes",)
    assert [{k: v for k, v in s.items() if k not in strip} for s in static.stats()] == [
        {k: v for k, v in s.items() if k not in strip} for s in dynamic.stats()
    ]


@pytest.mark.parametrize("case", ["streaming", "streaming-unprotected", "rkv", "snapkv", "rkv-unprotected"])
def test_a_shorter_request_reuses_the_tensors_and_still_matches(left_padded_batch, case):
    """A second request with a shorter prompt keeps the first one's tensors (same addresses, so a
    captured graph replays), its early region then starts later, and results still equal the dynamic cache's."""
    model = tiny_model("llama")
    config = _config(model, case)
    input_ids, attention_mask = left_padded_batch
    static = make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] + STEPS)
    greedy_generate(model, left_padded_batch, static)
    addresses = [[t.data_ptr() for t in layer.buffers.values()] for layer in static.layers]
    shorter = (input_ids[:, 5:], attention_mask[:, 5:])
    got = greedy_generate(model, shorter, static)
    assert [[t.data_ptr() for t in layer.buffers.values()] for layer in static.layers] == addresses
    dynamic = make_cache(model, config)
    expected = greedy_generate(model, shorter, dynamic)
    assert torch.equal(got.sequences, expected.sequences)
    for dyn_layer, static_layer in zip(dynamic.layers, static.layers, strict=True):
        if dyn_layer.store is not None:
            assert _position_sets(static_layer.kept_positions()) == _position_sets(dyn_layer.store.positions)


@pytest.mark.parametrize("case", ["streaming", "rkv", "snapkv"])
def test_a_wider_request_up_to_max_prompt_len_keeps_the_tensors_and_still_matches(left_padded_batch, case):
    """Sized for the widest prompt at the first (narrower) request: the wider one reuses the tensors
    (where the prompt lives in the early region, it would otherwise reallocate) and equals the dynamic cache."""
    model = tiny_model("llama")
    config = _config(model, case)
    input_ids, attention_mask = left_padded_batch
    shorter = (input_ids[:, 5:], attention_mask[:, 5:])
    width = input_ids.shape[1]
    static = make_cache(model, config, static=True, max_cache_len=width + STEPS, max_prompt_len=width)
    greedy_generate(model, shorter, static)
    addresses = [[t.data_ptr() for t in layer.buffers.values()] for layer in static.layers]
    got = greedy_generate(model, left_padded_batch, static)
    assert [[t.data_ptr() for t in layer.buffers.values()] for layer in static.layers] == addresses
    expected = greedy_generate(model, left_padded_batch, make_cache(model, config))
    assert torch.equal(got.sequences, expected.sequences)
    unsized = make_cache(model, config, static=True, max_cache_len=width + STEPS)
    greedy_generate(model, shorter, unsized)
    grew = [layer.early for layer in unsized.layers]
    greedy_generate(model, left_padded_batch, unsized)
    assert [layer.early for layer in unsized.layers] != grew  # without the size hint it reallocates


@pytest.mark.parametrize("case", ["streaming", "rkv"])
def test_compiled_decode_keeps_one_graph_for_prompts_of_different_widths(left_padded_batch, case):
    """transformers' compiled decode (fullgraph, static shapes) over a narrower, then a wider request on
    one cache sized by max_prompt_len: one graph, no recompile, the eager tokens."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch
    width = input_ids.shape[1]
    requests = [(input_ids[:, 5:], attention_mask[:, 5:]), left_padded_batch]
    config = _config(model, case)
    eager = [
        greedy_generate(model, r, make_cache(model, config), steps=24, disable_compile=True).sequences
        for r in requests
    ]
    cache = make_cache(model, config, static=True, max_cache_len=width + 24, max_prompt_len=width)
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for request, expected in zip(requests, eager, strict=True):
            got = greedy_generate(model, request, cache, steps=24, compile_config=compile_config)
            assert torch.equal(got.sequences, expected)
    assert len(graphs) == 1
    torch.compiler.reset()


def test_streaming_keeps_sink_and_window_at_logical_positions(left_padded_batch):
    """Unprotected streaming: each row keeps its first SINK real columns and the last WINDOW columns."""
    model = tiny_model("qwen2")
    input_ids, attention_mask = left_padded_batch
    cache = make_cache(
        model, _config(model, "streaming-all-heads"), static=True, max_cache_len=input_ids.shape[1] + STEPS
    )
    greedy_generate(model, left_padded_batch, cache)
    length = input_ids.shape[1] + STEPS - 1  # the last token is sampled, never fed
    for layer in cache.layers:
        for row, heads in enumerate(_position_sets(layer.kept_positions())):
            start = int((attention_mask[row] == 0).sum())
            expected = [*range(start, start + SINK), *range(length - WINDOW, length)]
            assert heads == [expected] * len(heads)


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("streaming")])
def test_unpadded_rows_compact_one_run_of_slots_as_the_dynamic_cache(case):
    """Rows without padding: each compaction's policy view is the one run of slots the dynamic store lists
    (`unpadded_run`), and a top-scores policy's kept slots move in place (`keep_in_run`). Same
    tokens, logits (1e-5), kept positions and evictions as the dynamic cache."""
    model = tiny_model("llama")
    config = _config(model, case)
    batch = (torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(1)), torch.ones(2, 20))
    dynamic = make_cache(model, config)
    expected = greedy_generate(model, batch, dynamic)
    static = make_cache(model, config, static=True, max_cache_len=20 + STEPS)
    got = greedy_generate(model, batch, static)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
    evicted = 0
    for dyn_layer, static_layer in zip(dynamic.layers, static.layers, strict=True):
        if dyn_layer.store is not None:
            assert _position_sets(static_layer.kept_positions()) == _position_sets(dyn_layer.store.positions)
            evicted += int(dyn_layer.store.evicted.sum())
            generated = static_layer.host_length - static_layer.prompt_width
            last = static_layer.schedule.last_compaction(generated + 1)
            run = unpadded_run(static_layer.form, static_layer.early, 20, generated, last, [0, 0])
            assert static_layer.shared["row_starts"] == [0, 0] and run is not None
    assert evicted > 0


@pytest.mark.parametrize("case", ["rkv-unprotected", "knorm-ratio-unprotected"])
def test_a_prompt_over_budget_compacts_in_the_prefill_as_the_dynamic_cache(left_padded_batch, case):
    """An unprotected prompt over the budget is compacted at the end of the prefill forward, where the
    dynamic cache compacts it, so the first decode step pays no compaction: after the prefill every
    compressed layer keeps the dynamic cache's positions and none is due before the first step."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch
    config = _config(model, case)
    caches = (
        make_cache(model, config),
        make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] + 4),
    )
    with torch.no_grad():
        for cache in caches:
            model(input_ids=input_ids, attention_mask=attention_mask, **cache_kwargs(cache), use_cache=True)
    dynamic, static = caches
    compacted = 0
    for dyn_layer, static_layer in zip(dynamic.layers, static.layers, strict=True):
        if dyn_layer.store is not None:
            compacted += static_layer.compacted_at == input_ids.shape[1]
            positions = static_layer.buffers["comp_pos"].long()
            assert _position_sets(positions) == _position_sets(dyn_layer.store.positions)
    assert compacted  # the prompt was over budget in the compressed layers


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("protect_prompt", [True, False])
@pytest.mark.parametrize("rows", [3, 4])
def test_streaming_rows_shorter_than_the_sink_decode_as_the_dynamic_cache(
    left_padded_batch, rows, protect_prompt
):
    """Real prompts of 15, 21, 31 (and 3) tokens, sink 8: a decode token is a sink token only in the
    3-token row, so eager steps write every row's sink slot until that row passes its sink
    (`sink_until`, the latest row start + sink) and, without it, the ring slot alone from the first step.
    Both keep the dynamic cache's tokens, logits (1e-5) and positions."""
    batch = tuple(t[:rows] for t in left_padded_batch)
    model = tiny_model("llama")
    config = CompressionConfig(
        head_mask=_mixed_mask(model), sink=8, window=WINDOW, protect_prompt=protect_prompt
    )
    dynamic = make_cache(model, config)
    expected = greedy_generate(model, batch, dynamic)
    width = batch[0].shape[1]
    static = make_cache(model, config, static=True, max_cache_len=width + STEPS)
    got = greedy_generate(model, batch, static)
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-5)
    latest_start = int((batch[1] == 0).sum(1).max())
    for dyn_layer, static_layer in zip(dynamic.layers, static.layers, strict=True):
        if dyn_layer.store is not None:
            assert _position_sets(static_layer.kept_positions()) == _position_sets(dyn_layer.store.positions)
            assert static_layer.sink_until == latest_start + 8
    assert (static.layers[0].sink_until > width) == (rows == 4)


def test_sparsity0_token_identical_to_plain_generate(model, left_padded_batch):
    input_ids, attention_mask = left_padded_batch
    plain = model.generate(
        input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24, do_sample=False
    )
    config = CompressionConfig(head_mask=_mixed_mask(model), sparsity=0.0)
    cache = make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] + 24)
    assert torch.equal(greedy_generate(model, left_padded_batch, cache, steps=24).sequences, plain)


def _capacity(model, cache: StaticHeadMixedCache, batch: int, width: int) -> int:
    """Analytic bytes of the static layout: full columns, compressed slots + int32 positions, the policy's
    per-slot buffers, observation queries, per-layer bookkeeping (row starts and region offsets per row,
    3 counters, head indices), the full-head mask."""
    cfg = model.config
    dim, groups = cfg.head_dim, cfg.num_attention_heads // cfg.num_key_value_heads
    element = 4  # fp32
    settings, form = cache.settings, cache.form
    if form.kind == "budget":
        early = width
    else:
        early = max(settings.sink, width) if settings.protect_prompt else settings.sink
    slots = early + form.region_slots(settings.window)
    total = cache.full_heads.numel()  # bool
    for layer, full in zip(cache.layers, cache.full_heads.tolist(), strict=True):
        h_full, h_comp = sum(full), len(full) - sum(full)
        total += 2 * batch * h_full * cache.max_cache_len * dim * element
        total += batch * h_comp * slots * (2 * dim * element + 4)
        total += batch * h_comp * slots * 4 * len(layer.slot_fills)  # per-slot fp32 buffers (H2O's sums)
        total += batch * h_comp * groups * form.observe * dim * element
        total += 8 * (2 * batch + 3 + (batch if h_comp else 0) + (h_full + h_comp) * (1 + groups))
    return total


@pytest.mark.parametrize("case", ["streaming", "rkv", "h2o", "rpc", "knorm-ratio"])
def test_resident_bytes_equal_the_analytic_capacity(left_padded_batch, case):
    model = tiny_model("llama")
    input_ids = left_padded_batch[0]
    cache = make_cache(model, _config(model, case), static=True, max_cache_len=input_ids.shape[1] + STEPS)
    greedy_generate(model, left_padded_batch, cache)
    expected = _capacity(model, cache, *input_ids.shape)
    assert cache.resident_bytes() == expected
    dynamic = make_cache(model, _config(model, case))
    greedy_generate(model, left_padded_batch, dynamic)
    assert cache.resident_bytes() < dynamic.full_resident_bytes()  # compression is real


def test_rows_are_independent(left_padded_batch):
    model = tiny_model("llama")
    config = _config(model, "rkv")
    input_ids, attention_mask = left_padded_batch
    cache = make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] + STEPS)
    batched = greedy_generate(model, left_padded_batch, cache).sequences[:, input_ids.shape[1] :]
    for row in range(input_ids.shape[0]):
        real = input_ids[row, attention_mask[row].bool()][None]
        alone = greedy_generate(model, (real, torch.ones_like(real)), cache).sequences[0, real.shape[1] :]
        assert torch.equal(alone, batched[row])


# sentences that repeat, so SkipKV's redundancy penalty decides evictions (as in tests/test_policy_skipkv.py)
TRACE = (
    "let x be 3.\nthen x + 4 = 7.\nWait, check again.\nlet x be 3.\nthen x + 4 = 7.\n\n"
    "so the answer is 7.\nAlternatively 2 * 3 = 6.\nthen x + 4 = 7.\nlet x be 3.\n"
)


@torch.inference_mode()
def _teacher_force_kept(model, cache, batch, trace):
    """Prefill the left-padded batch, feed `trace` [T] to every row one token per direct forward (the 4D
    mask generate builds for a static cache, the growing 2D mask for a dynamic one); per step, the kept
    positions of every compressed layer and the logits."""
    input_ids, attention_mask = batch
    total = input_ids.shape[1] + len(trace)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = torch.cat([attention_mask, torch.ones(input_ids.shape[0], len(trace), dtype=torch.long)], 1)
    static = isinstance(cache, StaticHeadMixedCache)
    model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **cache_kwargs(cache))
    kept, logits = [], []
    for step, token in enumerate(trace):
        column = input_ids.shape[1] + step
        mask = (
            real[:, None, None, :].bool() & (torch.arange(total) <= column)
            if static
            else real[:, : column + 1]
        )
        out = model(
            input_ids=torch.full((input_ids.shape[0], 1), token),
            attention_mask=mask,
            position_ids=positions[:, -1:] + 1 + step,
            **cache_kwargs(cache),
        )
        logits.append(out.logits[:, -1])
        layers = [layer.kept_positions() if static else layer.store.positions for layer in cache.layers]
        kept.append([_position_sets(p) for p in layers if p is not None])
    return kept, torch.stack(logits)


@pytest.mark.cross_path_floats
def test_skipkv_keeps_the_dynamic_caches_sentences_at_every_step(left_padded_batch):
    """Teacher-forced over repeating sentences: the static SkipKV keeps the dynamic one's positions after
    every step (the redundancy penalty deciding: R-KV alone keeps others), with its logits."""
    model = tiny_model("llama")
    trace = tiny_tokenizer()(TRACE)["input_ids"]
    config = _config(model, "skipkv")
    max_len = left_padded_batch[0].shape[1] + len(trace)
    expected, expected_logits = _teacher_force_kept(
        model, make_cache(model, config), left_padded_batch, trace
    )
    static = make_cache(model, config, static=True, max_cache_len=max_len)
    got, logits = _teacher_force_kept(model, static, left_padded_batch, trace)
    assert got == expected
    torch.testing.assert_close(logits, expected_logits, rtol=0, atol=1e-5)
    assert static.policy.sentence_penalty().amax() > 0  # redundant sentences were found
    rkv = CompressionConfig(**{**config.__dict__, "policy": "rkv", "policy_kwargs": dict(buffer=4)})
    rkv_kept, _ = _teacher_force_kept(
        model, make_cache(model, rkv, static=True, max_cache_len=max_len), left_padded_batch, trace
    )
    assert rkv_kept != got


@pytest.mark.parametrize(
    "kwargs",
    [
        # steering decodes each finished sentence's text on the host
        dict(policy="skipkv", budget=32, policy_kwargs=dict(tokenizer=tiny_tokenizer(), steering="STEER")),
        dict(policy="rpc", policy_kwargs=dict(interval=8, ratio=4, selector_window=2)),  # target 4 < 6
    ],
    ids=["skipkv-steering", "rpc-target-below-forced"],
)
def test_layouts_without_a_static_form_name_the_fix(kwargs):
    model = tiny_model("llama")
    if kwargs["policy_kwargs"].get("steering") == "STEER":
        vector = SteeringVector(vector=torch.ones(model.config.hidden_size), layer=0)
        kwargs = {**kwargs, "policy_kwargs": {**kwargs["policy_kwargs"], "steering": vector}}
    config = CompressionConfig(head_mask=None, sink=SINK, window=WINDOW, **kwargs)
    with pytest.raises(StaticCacheError, match="static_cache=False"):
        make_cache(model, config, static=True, max_cache_len=64)


def test_lengths_beyond_max_cache_len_are_refused(left_padded_batch):
    model = tiny_model("llama")
    input_ids = left_padded_batch[0]
    config = _config(model, "streaming")
    with pytest.raises(StaticCacheError, match="max_cache_len"):
        make_cache(model, config, static=True)
    short = make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] - 1)
    with pytest.raises(StaticCacheError, match="max_cache_len="):
        greedy_generate(model, left_padded_batch, short)
    tight = make_cache(model, config, static=True, max_cache_len=input_ids.shape[1] + 2)
    with pytest.raises(StaticCacheError, match="max_cache_len="):
        greedy_generate(model, left_padded_batch, tight, steps=4)


@pytest.mark.parametrize(
    "case",
    [
        "streaming",
        "rkv",
        "snapkv",
        "knorm",
        "sink-recent",
        "rpc",
        "h2o",
        "h2o-ratio",
        "rkv-ratio",
        "rkv-unprotected",
        "knorm-ratio-unprotected",
        "rpc-own-target",
        "h2o-unprotected",
        "skipkv",
        "random-ratio-unprotected",
    ],
)
def test_decode_steps_never_read_the_device(left_padded_batch, case):
    """Every decode step, compaction steps included, runs without a host sync."""
    model = tiny_model("llama")
    input_ids, attention_mask = left_padded_batch
    steps = 20
    total = input_ids.shape[1] + steps
    cache = make_cache(model, _config(model, case), static=True, max_cache_len=total)
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    real = torch.cat([attention_mask, torch.ones(input_ids.shape[0], steps, dtype=torch.long)], 1).bool()
    counts = []
    with torch.inference_mode():
        out = model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, **cache_kwargs(cache)
        )
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        for step in range(steps - 1):
            column = input_ids.shape[1] + step
            mask = real[:, None, None, :] & (torch.arange(total) <= column)  # the 4D mask generate builds
            with HostSyncCounter() as syncs:
                out = model(
                    input_ids=token,
                    attention_mask=mask,
                    position_ids=positions[:, -1:] + 1 + step,
                    **cache_kwargs(cache),
                )
                token = out.logits[:, -1].argmax(-1, keepdim=True)
            counts.append(syncs.count)
    assert counts == [0] * (steps - 1)
    if cache.form.kind == "budget":
        assert any(layer.compacted_at > 0 for layer in cache.layers)  # compaction steps were among them


@pytest.mark.parametrize(
    "case",
    [
        "streaming",
        "rkv",
        "rpc",
        "h2o",
        "rkv-ratio",
        "knorm-ratio-unprotected",
        "rpc-ratio-unprotected",
        "skipkv",
    ],
)
def test_compiled_decode_runs_64_steps_without_recompiling(left_padded_batch, case):
    """transformers' compiled decode (fullgraph, static shapes) captures one graph and replays it."""
    model = tiny_model("llama")
    input_ids = left_padded_batch[0]
    cache = make_cache(model, _config(model, case), static=True, max_cache_len=input_ids.shape[1] + 64)
    eager = greedy_generate(model, left_padded_batch, cache, steps=64, disable_compile=True).sequences
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second request replays the same graph (same addresses, same shapes)
            compiled = greedy_generate(
                model, left_padded_batch, cache, steps=64, compile_config=compile_config
            )
            assert torch.equal(compiled.sequences, eager)
    assert len(graphs) == 1
    torch.compiler.reset()


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("case", ["streaming", "rkv"])
def test_compiled_decode_of_unpadded_rows_gives_the_eager_tokens(case):
    """Rows without padding: an eager step reads the full heads' written columns and a budget's written
    run of slots, without a mask (the dynamic cache's shapes); a compiled step reads every slot under a
    mask (one graph for every step). Other shapes, so tokens equal and logits within 1e-5, one graph."""
    model = tiny_model("llama")
    batch = (torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2)), torch.ones(2, 20))
    cache = make_cache(model, _config(model, case), static=True, max_cache_len=20 + 32)
    eager = greedy_generate(model, batch, cache, steps=32, disable_compile=True)
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = greedy_generate(model, batch, cache, steps=32, compile_config=compile_config)
    assert torch.equal(compiled.sequences, eager.sequences)
    torch.testing.assert_close(torch.stack(compiled.logits), torch.stack(eager.logits), rtol=0, atol=1e-5)
    assert len(graphs) == 1
    torch.compiler.reset()


def test_generate_static_cache_option(tokenizer):
    """`generate(static_cache=True)` gives the dynamic cache's outputs, and each row's stats at the step it
    ended (two rows end with EOS while the third runs on)."""
    model = tiny_model("llama")
    config = _config(model, "rkv")
    prompts = ["let x be 3 then x + 4 = 7", "solve the following math problem", "wait"]
    runs = [
        generate(
            model,
            tokenizer,
            prompts,
            40,
            compression=config,
            static_cache=static,
            progress=False,
            apply_chat_template=False,
        )
        for static in (False, True)
    ]
    dynamic, static = (
        [(o.token_ids, o.finish_reason, {**o.cache_stats, "resident_bytes": 0}) for o in run] for run in runs
    )
    assert static == dynamic
    assert [reason for _, reason, _ in static].count("eos") == 2
    vector = SteeringVector(vector=torch.ones(model.config.hidden_size), layer=0)
    skipkv = CompressionConfig(
        policy="skipkv", budget=96, policy_kwargs=dict(tokenizer=tokenizer, steering=vector)
    )
    with pytest.raises(StaticCacheError, match="static_cache=False"):
        generate(model, tokenizer, prompts, 4, compression=skipkv, static_cache=True, progress=False)
    # None on CPU: the dynamic cache, so a layout without a static form still generates
    assert len(generate(model, tokenizer, prompts, 4, compression=skipkv, progress=False)) == len(prompts)


def test_cli_no_static_cache_flag(capsys):
    """`rlkv generate --no-static-cache` is accepted and, on CPU (dynamic cache either way), changes nothing."""
    from rlkv.cli import main

    argv = ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "3", "--json"]
    printed = []
    for extra in ([], ["--no-static-cache"]):
        assert main(argv + extra) in (0, None)
        printed.append(capsys.readouterr().out)
    assert printed[0] == printed[1] and '"token_ids"' in printed[0]


def test_one_cache_serves_requests_in_and_out_of_inference_mode(left_padded_batch):
    """The static tensors are normal tensors even when the first request ran under inference mode (an
    inference tensor could not be written in place by a later request outside it)."""
    model = tiny_model("llama")
    input_ids = left_padded_batch[0]
    cache = make_cache(model, _config(model, "rkv"), static=True, max_cache_len=input_ids.shape[1] + 12)
    with torch.inference_mode():
        inside = greedy_generate(model, left_padded_batch, cache, steps=12).sequences
    with torch.no_grad():
        outside = greedy_generate(model, left_padded_batch, cache, steps=12).sequences
    assert torch.equal(inside, outside)
