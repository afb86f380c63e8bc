"""Fast paths: cache storage that grows in chunks instead of one copy per step; compaction by whole
rows; R-KV's blocked redundancy.

Properties: decoding past 128 tokens writes new tokens into spare capacity (the history's storage
stays in place), the spare capacity is at most 1/128 of the stored tokens and is counted in
`resident_bytes()`, and the outputs equal a plain `DynamicCache` run exactly as before. Compaction
keeps slots in position order in exactly sized new tensors, and every policy generates exactly as
with a slot-by-slot reference compaction. The redundancy computed in blocks (symmetric,
newest-first) equals the dense K x K matrix.
"""

import pytest
import torch
from policy_matrix import POLICY_MATRIX
from policy_properties import generate_with_logits
from transformers import DynamicCache

from rlkv import HeadMask
from rlkv.cache import GROWTH_DIVISOR, append_along_tokens
from rlkv.cache.growth import SMALL_STORE_BYTES, grows_in_place
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.store import CompressedStore
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies import get_policy
from rlkv.policies.rkv import key_redundancy

pytestmark = pytest.mark.cross_path_floats  # floats compared across code paths (CONTRIBUTING.md)


def test_append_along_tokens_grows_by_a_bounded_fraction_and_keeps_content():
    gen = torch.Generator().manual_seed(0)
    chunks = [torch.randn(2, 3, n, 16, generator=gen) for n in (300, 1, 1, 5, 1)]  # 112 KiB: grows
    storage = current = None
    reallocations = 0
    for chunk in chunks:
        before = None if storage is None else storage.data_ptr()
        storage = append_along_tokens(storage, current, chunk)
        used = chunk.shape[2] + (0 if current is None else current.shape[2])
        current = storage[:, :, :used]
        reallocations += storage.data_ptr() != before
        # capacity = used + used // 128 at the last growth: never more than 1/128 spare
        assert used <= storage.shape[2] <= used + used // GROWTH_DIVISOR + chunk.shape[2]
        assert (
            storage.shape[2] * GROWTH_DIVISOR <= used * (GROWTH_DIVISOR + 1) + chunk.shape[2] * GROWTH_DIVISOR
        )
    assert torch.equal(current, torch.cat(chunks, dim=2))
    assert reallocations == 2  # the first chunk, then the 5-token chunk outgrew the 2 spare slots
    # below 128 tokens nothing is spare
    small = append_along_tokens(None, None, torch.zeros(1, 1, 127, 2))
    assert small.shape[2] == 127


def test_long_decode_writes_in_place_counts_capacity_and_matches_dynamic_cache(make_model):
    model, reference = make_model("llama"), make_model("llama")
    mask = HeadMask.random(model, seed=3)
    # 6 rows: a full head's 200 tokens (6 x 200 x 16 dims fp32 = 75 KiB) pass SMALL_STORE_BYTES, so it grows
    prompt = torch.randint(0, model.config.vocab_size, (6, 200), generator=torch.Generator().manual_seed(1))
    spare = 200 // GROWTH_DIVISOR  # tokens that fit in the capacity left by the prefill

    # one full + one streaming head per layer: the full head's history is never copied while it fits
    mixed = make_cache(
        model, CompressionConfig(head_mask=mask, sparsity=0.5, min_full_per_layer=1, sink=4, window=16)
    )
    with torch.no_grad():
        model(input_ids=prompt, **cache_kwargs(mixed))
        pointers = [layer.keys.data_ptr() for layer in mixed.layers]
        for _ in range(spare):
            model(input_ids=prompt[:, :1], **cache_kwargs(mixed))
    for layer, pointer in zip(mixed.layers, pointers, strict=True):
        assert layer.full_idx.numel() == 1
        assert layer.keys.data_ptr() == pointer  # no copy of the history
        assert layer.keys.shape[2] == layer.logical_length == 200 + spare
        assert layer.keys.untyped_storage().nbytes() == 6 * (200 + spare) * 16 * 4  # B=6, 1 head, D=16, fp32

    # sparsity 0: same logits as a DynamicCache; the capacity is counted
    everything = make_cache(model, CompressionConfig(head_mask=mask, sparsity=0.0))
    ref_cache = DynamicCache(config=reference.config)
    tokens = prompt
    with torch.no_grad():
        for _ in range(spare + 4):  # prefill, then decode past the first growth
            length = everything.get_seq_length()
            logits = model(input_ids=tokens[:, length:], **cache_kwargs(everything)).logits[:, -1]
            ref_logits = reference(input_ids=tokens[:, length:], **cache_kwargs(ref_cache)).logits[:, -1]
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=1e-5)
            tokens = torch.cat([tokens, ref_logits.argmax(-1, keepdim=True)], dim=1)
    used = sum(layer.keys.numel() + layer.values.numel() for layer in everything.layers) * 4
    stored = sum(
        layer.keys.untyped_storage().nbytes() + layer.values.untyped_storage().nbytes()
        for layer in everything.layers
    )
    assert used < stored <= used * (1 + 1 / GROWTH_DIVISOR)  # spare capacity is real and bounded
    indices = sum(t.numel() * 8 for layer in everything.layers for t in layer.tensors()[2:])
    assert everything.resident_bytes() == stored + indices + everything.full_heads.numel()


def _dense_redundancy(keys, valid, threshold, exempt):
    """R-KV redundancy from the full K x K similarity matrix (plain reference, float64)."""
    normed = torch.nn.functional.normalize(keys.double(), dim=-1) * valid[..., None]
    sim = normed @ normed.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    slots = keys.shape[2]
    recency = torch.arange(1, slots + 1, dtype=torch.float64)
    rank, index = ((sim > threshold) * recency).topk(exempt, dim=-1)
    sim.scatter_(-1, index, torch.where(rank > 0, 0.0, sim.gather(-1, index)))
    mean = (sim.sum(dim=2) / valid.sum(-1, keepdim=True)).masked_fill(~valid, float("-inf"))
    return torch.softmax(mean, dim=-1)


def test_blocked_redundancy_equals_the_dense_matrix():
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 300, 16, generator=gen)
    keys[:, :, 40:120] = keys[:, :, 40:41] + 0.4 * torch.randn(2, 3, 80, 16, generator=gen)  # a cluster
    keys[:, :, 200:210] = keys[:, :, 250:251] + 0.8 * torch.randn(2, 3, 10, 16, generator=gen)
    valid = torch.ones(2, 3, 300, dtype=torch.bool)
    valid[1, 2, :37] = False  # empty slots
    for exempt in (1, 2):
        want = _dense_redundancy(keys, valid, 0.5, exempt)
        for chunk in (7, 64, 256, 1000):
            got = key_redundancy(keys, valid, threshold=0.5, recent_exempt=exempt, chunk=chunk)
            torch.testing.assert_close(got.double(), want, atol=1e-7, rtol=1e-5)


# --- compaction: whole-row copies when every (row, head) keeps the same count ------------------------


def _store_with_spare_capacity(batch: int = 3, heads: int = 2, dim: int = 16) -> CompressedStore:
    """A store of 301 slots whose keys/values/positions and slot buffer are prefix views of storages
    with spare capacity (two different capacities: the buffer was created after the first append)."""
    settings = CompressionSettings(
        get_policy("streaming"), sink=2, window=4, budget=None, protect_prompt=False
    )
    store = CompressedStore(0, torch.arange(heads), 2, settings)
    store.row_start = torch.zeros(batch, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    store.append(
        torch.randn(batch, heads, 300, dim, generator=gen), torch.randn(batch, heads, 300, dim, generator=gen)
    )
    store.slot_buffer("score").copy_(torch.rand(batch, heads, 300, generator=gen))
    store.append(
        torch.randn(batch, heads, 1, dim, generator=gen), torch.randn(batch, heads, 1, dim, generator=gen)
    )
    assert not store.keys.is_contiguous() and not store.slot_buffer("score").is_contiguous()
    return store


def _expected_after_compact(store: CompressedStore, keep: torch.Tensor) -> dict[str, list]:
    """Per (row, head): the kept slots' keys, values, positions and buffer values, in slot order."""
    tensors = {
        "keys": store.keys,
        "values": store.values,
        "positions": store.positions,
        "score": store.slot_buffer("score"),
    }
    cells = [(b, h) for b in range(keep.shape[0]) for h in range(keep.shape[1])]
    return {name: [t[b, h][keep[b, h]].clone() for b, h in cells] for name, t in tensors.items()}


def _assert_exactly_sized(tensor: torch.Tensor) -> None:
    assert tensor.is_contiguous()
    assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("layout", ["same-columns", "equal-counts", "padded"])
def test_compact_keeps_slots_in_order_in_exactly_sized_new_tensors(layout, monkeypatch):
    store = _store_with_spare_capacity()
    batch, heads, slots = store.positions.shape
    gen = torch.Generator().manual_seed(1)
    calls = _fast_path_spy(monkeypatch)
    equal_counts = layout != "padded"
    if layout == "same-columns":  # the same 40 slots of every (row, head): whole columns
        keep = (torch.rand(slots, generator=gen).argsort() < 40).expand(batch, heads, slots)
    elif layout == "equal-counts":  # 40 random slots per (row, head)
        keep = torch.rand(batch, heads, slots, generator=gen).argsort(-1) < 40
    else:
        keep = torch.rand(batch, heads, slots, generator=gen) < torch.tensor([0.1, 0.3, 0.5])[:, None, None]
    expected = _expected_after_compact(store, keep)
    old_storages = {t.untyped_storage().data_ptr() for t in (store.keys, store.values, store.positions)}
    store.compact(keep)
    counts = keep.sum(-1)
    assert store.positions.shape == (batch, heads, int(counts.max()))
    assert store.all_valid == equal_counts
    assert store.evicted.tolist() == (slots * heads - counts.sum(-1)).tolist()
    actual = {
        "keys": store.keys,
        "values": store.values,
        "positions": store.positions,
        "score": store.slot_buffer("score"),
    }
    for name, tensor in actual.items():
        _assert_exactly_sized(tensor)  # no spare capacity and no view of the old storage
        assert tensor.untyped_storage().data_ptr() not in old_storages
        for cell, want in enumerate(expected[name]):
            got = tensor[cell // heads, cell % heads]
            assert torch.equal(got[: want.shape[0]], want), f"{name}, (row, head) {divmod(cell, heads)}"
    assert bool((store.positions.diff(dim=-1)[store.positions[..., 1:] >= 0] > 0).all())  # still in order
    assert [path for path, _ in calls] == {"same-columns": ["columns"], "equal-counts": ["rows"]}.get(
        layout, []
    )


def _fast_path_spy(monkeypatch) -> list[tuple[str, int]]:
    """Records the compactions that took a fast path: ("columns" | "rows" | "slots", slots kept per
    (row, head))."""
    calls: list[tuple[str, int]] = []
    take_slots, take_columns = CompressedStore._take_slots, CompressedStore._take_columns
    take_ends, compact_slots = CompressedStore._take_ends, CompressedStore.compact_slots

    def slots_spy(self, slots):
        calls.append(("slots", slots.shape[-1]))  # the kept slots as indices (`select_top_scores`)
        return compact_slots(self, slots)

    def rows_spy(self, keep, size):
        calls.append(("rows", size))
        return take_slots(self, keep, size)

    def columns_spy(self, columns):
        calls.append(("columns", columns.numel()))
        return take_columns(self, columns)

    def ends_spy(self, early, size, positions=True):
        calls.append(("columns", size))  # two ranges of whole columns (no index): a columns path too
        return take_ends(self, early, size, positions)

    monkeypatch.setattr(CompressedStore, "_take_ends", ends_spy)
    monkeypatch.setattr(CompressedStore, "compact_slots", slots_spy)
    monkeypatch.setattr(CompressedStore, "_take_slots", rows_spy)
    monkeypatch.setattr(CompressedStore, "_take_columns", columns_spy)
    return calls


def _compact_slot_by_slot(self: CompressedStore, keep: torch.Tensor, kept: list[int] | None = None) -> None:
    """Reference compaction, one (row, head) at a time: kept slots first in order, then empty slots."""
    valid = self.valid()
    keep = keep & valid
    self.evicted += (valid & ~keep).sum(dim=(1, 2))
    self._recount(keep, kept)  # the host counts, as the cache keeps them
    self.uniform = False
    size = int(keep.sum(-1).max())
    batch, heads, _ = keep.shape
    named = {"keys": self.keys, "values": self.values, "positions": self.positions}
    named |= {f"slot:{name}": buf for name, (buf, _) in self._slot_buffers.items()}
    fills = {"positions": -1} | {f"slot:{name}": fill for name, (_, fill) in self._slot_buffers.items()}
    out = {
        name: torch.full((batch, heads, size, *t.shape[3:]), fills.get(name, 0), dtype=t.dtype)
        for name, t in named.items()
    }
    for b in range(batch):
        for h in range(heads):
            for name, t in named.items():
                kept = t[b, h][keep[b, h]]
                out[name][b, h, : kept.shape[0]] = kept
    self.keys, self.values, self.positions = out["keys"], out["values"], out["positions"]
    for name, (_, fill) in self._slot_buffers.items():
        self._slot_buffers[name] = (out[f"slot:{name}"], fill)
    self._capacity.clear()
    self.all_valid = bool((self.positions >= 0).all())
    self._slots_changed()


def _greedy_logits(model, policy_name, tokenizer, batch, new_tokens, **cache_kwargs):
    """(tokens [B, new], logits [new, B, V], cache) of the policy's matrix row on `batch` (ids, mask)."""
    policy = get_policy(policy_name, **POLICY_MATRIX[policy_name].kwargs(tokenizer))
    return generate_with_logits(model, policy, *batch, new_tokens, **cache_kwargs)


def _compact_slots_slot_by_slot(self: CompressedStore, slots: torch.Tensor) -> None:
    """Reference of `compact_slots`: the mask of the given slots, compacted slot by slot."""
    keep = torch.zeros_like(self.positions, dtype=torch.bool).scatter_(-1, slots, True)
    _compact_slot_by_slot(self, keep, [slots.shape[-1]] * slots.shape[0])


def _compact_ends_slot_by_slot(self: CompressedStore, kept: list[int]) -> None:
    """Reference of `compact_ends`: the mask of each row's early region and newest slots, compacted slot by slot."""
    early = self._early_ends()[0] - self.row_starts()[0]
    slot = torch.arange(self.positions.shape[2])
    keep = (slot < early) | (slot >= self.positions.shape[2] - (kept[0] - early))
    _compact_slot_by_slot(self, keep.expand_as(self.positions).clone(), kept)


@pytest.mark.parametrize("name", sorted(n for n, e in POLICY_MATRIX.items() if e.evicting is not None))
def test_every_policy_generates_as_with_slot_by_slot_compaction(
    name, make_model, tokenizer, left_padded_batch, monkeypatch
):
    """The same tokens and bit-identical logits as the reference compaction, on the left-padded batch
    with the prompt evictable (once rows are past their budget they keep equal counts, unless out of
    phase: then the padded path) and on its longest row alone (every head keeps the same count)."""
    entry = POLICY_MATRIX[name]
    model = make_model("qwen2")
    input_ids, attention_mask = left_padded_batch
    longest = int(attention_mask.sum(1).argmax())
    alone = input_ids[longest : longest + 1, attention_mask[longest].bool()]
    runs = [
        (left_padded_batch, dict(entry.evicting, protect_prompt=False)),
        ((alone, torch.ones_like(alone)), entry.evicting),
    ]
    evicted = 0
    for batch, settings in runs:
        with monkeypatch.context() as patch:
            calls = _fast_path_spy(patch)
            tokens, logits, cache = _greedy_logits(
                model, name, tokenizer, batch, entry.evicting_tokens, **settings
            )
            patch.setattr(CompressedStore, "compact", _compact_slot_by_slot)
            patch.setattr(CompressedStore, "compact_ends", _compact_ends_slot_by_slot)
            patch.setattr(CompressedStore, "compact_slots", _compact_slots_slot_by_slot)
            ref_tokens, ref_logits, _ = _greedy_logits(
                model, name, tokenizer, batch, entry.evicting_tokens, **settings
            )
        evicted += sum(s["evictions"] for s in cache.stats())
        assert torch.equal(tokens, ref_tokens)
        assert torch.equal(logits, ref_logits)
    assert evicted > 0 and calls, "vacuous: nothing evicted, or no fast compaction path ran"


def test_streaming_decode_holds_only_kept_tokens(make_model, monkeypatch):
    """Single-row streaming decode with a full head per layer (the decode benchmark's setting): every
    compaction takes the whole-columns path, the store holds exactly sink + window slots, and each slot
    holds the key of its logical position (layer 0, checked against a full forward): no evicted token
    stays in memory."""
    sink, window, new_tokens = 4, 8, 30
    model = make_model("llama")
    full_heads = torch.tensor([[True, False], [False, True]])
    calls = _fast_path_spy(monkeypatch)
    prompt = torch.randint(0, model.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(2))
    layout = dict(full_heads=full_heads, sink=sink, window=window, protect_prompt=False)
    tokens, _, cache = _greedy_logits(
        model, "streaming", None, (prompt, torch.ones_like(prompt)), new_tokens, **layout
    )
    # prefill, then every step
    assert len(calls) == 2 * new_tokens and set(calls) == {("columns", sink + window)}
    sequence = torch.cat([prompt, tokens[:, :-1]], dim=1)  # the last token was never fed back
    model.set_attn_implementation("sdpa")
    reference = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=sequence, **cache_kwargs(reference))
    ref_keys = reference.layers[0].keys  # [1, H_kv, T, D]: layer 0's keys do not depend on the cache
    store = cache.layers[0].store
    expected = list(range(sink)) + list(range(sequence.shape[1] - window, sequence.shape[1]))
    assert store.positions[0, 0].tolist() == expected
    for tensor in (store.keys, store.values, store.positions):
        _assert_exactly_sized(tensor)
    slot_keys = ref_keys[0, store.head_idx[0], store.positions[0, 0].long()]
    torch.testing.assert_close(store.keys[0, 0], slot_keys, rtol=0, atol=1e-5)


@pytest.mark.parametrize("tokens", [80, 300])
def test_short_store_appends_into_exactly_sized_tensors(tokens):
    """Below GROWTH_DIVISOR tokens or SMALL_STORE_BYTES an append reserves no spare capacity (a
    compressed head's store is copied once per decode step, never held twice over)."""
    current = torch.randn(2, 3, tokens, 4)
    assert current.nbytes < SMALL_STORE_BYTES
    new = torch.randn(2, 3, 1, 4)
    grown = append_along_tokens(None, current, new, in_place=grows_in_place(current))
    _assert_exactly_sized(grown)
    assert torch.equal(grown, torch.cat([current, new], dim=2))


def test_remembered_queries_are_the_last_window_across_ring_wraps():
    """The observation window (`queries`, `query_positions`) equals the last `limit` queries seen, oldest
    first, and their positions after prompt chunks and decode steps, across the ring's wraps (a 2-token
    forward split over its end included); the ring holds exactly `limit` queries."""
    settings = CompressionSettings(get_policy("snapkv"), sink=2, window=4, budget=None, protect_prompt=False)
    store = CompressedStore(0, torch.arange(2), 3, settings)
    store.row_start = torch.zeros(2, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    limit, seen = 5, []
    for q_len in (
        7,
        3,
        *[1] * 12,
        2,
        *[1] * 7,
        2,
    ):  # prompt chunks, decode, 2-token forwards (the last split)
        store.append(torch.randn(2, 2, q_len, 8, generator=gen), torch.randn(2, 2, q_len, 8, generator=gen))
        queries = torch.randn(2, 2, 3, q_len, 8, generator=gen)
        seen.append(queries)
        store.remember_queries(queries.flatten(1, 2), limit)  # as attention holds them: [B, H_c * G, Q, D]
        expected = torch.cat(seen, dim=3)[:, :, :, -limit:]
        assert torch.equal(store.queries, expected)
        first = store.logical_length - expected.shape[3]
        assert torch.equal(store.query_positions, torch.arange(first, store.logical_length))
        assert store.query_ring.ring.untyped_storage().nbytes() == limit * expected[:, :, :, :1].nbytes


def test_valid_and_forced_keep_follow_every_change_of_the_slots():
    """valid() and forced_keep() are computed once per store state: marking padding, appending and
    compacting each give fresh answers, equal to their definitions."""
    store = _store_with_spare_capacity()
    store.prompt_length = 10
    store.settings.protect_prompt = True

    def check():
        pos = store.positions
        valid = pos >= 0
        early = (pos < store.prompt_length) | (pos < store.row_start[:, None, None] + store.sink)
        forced = valid & (early | (pos >= store.logical_length - store.window))
        assert torch.equal(store.valid(), valid)
        assert torch.equal(store.forced_keep(), forced)

    check()
    store.mark_padding(torch.tensor([[True], [False], [True]]))
    check()
    # the cache sets row_start between a forward's append and its first forced_keep()
    store.row_start = torch.tensor([0, 3, 12])  # rows whose sink ends before / after the prompt
    store.append(torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16))
    check()
    store.compact(store.forced_keep())
    check()


def test_small_store_writes_decode_positions_when_read_and_holds_no_bytes_for_them():
    """A small store's decode appends write no positions until `positions` is read: then they are the
    logical positions T..T+n-1 in every (row, head), as an eager write would give (after prompt chunks,
    single steps and a 3-token forward), and meanwhile `tensors()` hold only the written ones."""
    settings = CompressionSettings(get_policy("knorm"), sink=2, window=4, budget=None, protect_prompt=False)
    store = CompressedStore(0, torch.arange(2), 3, settings)
    store.row_start = torch.zeros(2, dtype=torch.long)
    gen = torch.Generator().manual_seed(0)
    expected = []
    for q_len in (5, 1, 1, 3, 1):
        start = store.logical_length
        store.append(torch.randn(2, 2, q_len, 8, generator=gen), torch.randn(2, 2, q_len, 8, generator=gen))
        expected += range(start, start + q_len)
    assert store._positions.shape[2] == 5  # the prompt's, written at once (the first append)
    held = sum(t.untyped_storage().nbytes() for t in store.tensors() if t is not None)
    positions = store.positions
    assert positions.dtype == torch.int32
    assert torch.equal(positions, torch.tensor(expected, dtype=torch.int32).expand(2, 2, len(expected)))
    after = sum(t.untyped_storage().nbytes() for t in store.tensors() if t is not None)
    assert after - held == 2 * 2 * 6 * 4  # 6 deferred slots' int32 positions, now written
    store.append(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    store.positions = store.positions[:, :, 2:]  # a compaction's assignment drops what is pending
    assert store.positions[0, 0].tolist() == expected[2:] + [len(expected)]


@pytest.mark.parametrize("dim", [8, 1024])  # a small store (appends by `cat`), a large one (spare capacity)
@pytest.mark.parametrize("protect_prompt", [False, True])
def test_streaming_steps_keep_positions_deferred_and_logical(protect_prompt, dim):
    """A streaming store's per-step eviction (`compact_ends`) writes no positions once its window holds only
    decode tokens: the early region's positions stay one exactly sized tensor, the window's are deferred
    (`positions` writes them when read), and what `positions` reads is the logical positions kept, step by
    step, equal to the sink (or protected prompt) plus the newest `window` tokens. Before the window is all
    decode tokens (the prompt's tail in it), or in a store that appends into spare capacity (which
    writes each step's positions anyway), the positions are cut as written. Every step reads
    `positions` (writing the deferred ones), so each compaction starts from written positions too."""
    sink, window, prompt = 2, 4, 7
    settings = CompressionSettings(
        get_policy("streaming"), sink=sink, window=window, budget=None, protect_prompt=protect_prompt
    )
    store = CompressedStore(0, torch.arange(2), 1, settings)
    store.row_start, store.row_start_host = torch.zeros(2, dtype=torch.long), [0, 0]
    store.uniform = True
    gen = torch.Generator().manual_seed(0)
    early = prompt if protect_prompt else sink
    for q_len in (prompt, *[1] * 12):
        store.append(
            torch.randn(2, 2, q_len, dim, generator=gen), torch.randn(2, 2, q_len, dim, generator=gen)
        )
        store.prompt_length = prompt
        store.is_prefill = q_len > 1
        small = not grows_in_place(store.keys)
        assert small == (dim == 8)
        compacted = store.slot_counts[0] > early + window
        if compacted:
            store.compact_ends([early + window] * 2)
        end = store.logical_length
        if small and compacted and end - window >= prompt:  # a window of decode tokens: nothing written
            early_positions = store._positions
            assert store._pending_positions == window and early_positions.shape[2] == early
            assert early_positions.untyped_storage().nbytes() == 2 * 2 * early * 4
        kept = [*range(min(early, end)), *range(max(end - window, early), end)]
        assert store.positions[1, 1].tolist() == kept
        assert torch.equal(store.positions, store.positions[:1, :1].expand(2, 2, -1))
        assert store.evicted_host == [2 * (end - len(kept))] * 2
