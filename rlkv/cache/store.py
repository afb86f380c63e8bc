"""The compressed-head store of a `HeadMixedCache` (its tensors grow by rlkv/cache/growth.py).

`CompressedStore` holds one layer's compressed KV heads (keys, values, the logical position of every
slot) and is what a policy reads (the `PolicyStore` protocol of `rlkv.policies.base`). Eviction gathers
into new, exactly sized tensors, so freed entries leave memory; `storage_bytes` reads what tensors really
hold. See docs/design.md.

No host sync in a decode step: the store keeps each row's slot count, first real column and
evictions as Python ints (read from the device once per prompt forward), the policy decides from
them whether to compress and declares the kept counts (`CompressionPolicy.kept_counts`), so
`compact` gathers fixed-size index sets (`torch.nonzero_static`, a stable sort) and never reads
the keep mask.
"""

from __future__ import annotations

from typing import Any

import torch

from rlkv.cache.compaction import StoreCompaction
from rlkv.cache.growth import append_along_tokens, grows_in_place, token_prefix
from rlkv.cache.query_ring import ObservedQueries, QueryRing
from rlkv.cache.settings import CompressionSettings


def storage_bytes(tensors: list[torch.Tensor | None]) -> int:
    """Bytes of the distinct storages behind `tensors` (what they really hold in memory)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def position_dtype(end: int) -> torch.dtype:
    """The dtype of stored logical positions up to `end` (exclusive): int32 while they fit, else int64."""
    return torch.int32 if end <= 2**31 else torch.int64


class CompressedStore(StoreCompaction, ObservedQueries):
    """The compressed KV heads of one layer: kept keys/values and their logical positions.

    This is what a policy sees: it satisfies `rlkv.policies.base.PolicyStore`, whose docstring
    documents every attribute (docs/design.md, "Cache layout").
    """

    def __init__(
        self, layer_idx: int, head_idx: torch.Tensor, num_groups: int, settings: CompressionSettings
    ):
        self.layer_idx = layer_idx
        self.head_idx = head_idx
        self.num_groups = num_groups
        self.settings = settings
        self.sink = settings.sink
        self.window = settings.window
        self.clear()

    def clear(self) -> None:
        """Drop every tensor and all per-sequence state."""
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self._positions: torch.Tensor | None = None
        # the newest slots appended by the small-store path have positions logical_length - n ..
        # logical_length - 1 in every (row, head): kept as this count and written when `positions` is read
        self._pending_positions = 0
        # how many of the newest slots are known, on the host, to hold logical_length - n .. logical_length - 1
        # in every (row, head): appends extend the run, `compact_ends` keeps its newest part, any other
        # change of the positions ends it (0 is always safe)
        self._tail_run = 0
        # observation queries: a ring (`remember_queries`), or set explicitly (a static cache's view)
        self.query_ring = QueryRing()
        self._queries: torch.Tensor | None = None
        self._query_positions: torch.Tensor | None = None
        self.view_oldest_query: int | None = None
        self.row_start: torch.Tensor | None = None  # LongTensor[B]: first real column of each row
        self.evicted: torch.Tensor | None = None
        self.logical_length = 0
        self.prompt_length = 0
        self.is_prefill = False
        self.state: dict[str, Any] = {}
        self._slot_buffers: dict[str, tuple[torch.Tensor, float]] = {}
        # name -> storage that the tensor of that name is a prefix view of (see append_along_tokens)
        self._capacity: dict[str, torch.Tensor] = {}
        self._valid: torch.Tensor | None = None  # valid() and forced_keep() of the current slots,
        self._forced: torch.Tensor | None = None  # computed once per store state (see _slots_changed)
        self.all_valid = True  # no empty slot (lets attention skip building a mask)
        # host mirrors (Python ints per batch row), so that no decode step reads the device:
        self.row_start_host: list[int] | None = None  # first real column of each row
        self.slot_counts: list[int] = []  # valid slots per (row, KV head); every head of a row alike
        self.head_counts: list[list[int]] | None = None  # per (row, head), only when heads differ
        self.evicted_host: list[int] = []  # KV entries evicted per row (over this layer's heads)
        # every (row, head) holds the same positions (no padding, or rows padded alike, and only
        # position-only selections so far): compaction copies whole columns
        self.uniform = False

    # what policies read ------------------------------------------------------------------
    @property
    def positions(self) -> torch.Tensor | None:
        """IntTensor[B, H_c, K]: the logical position of every slot (-1: empty); the slots appended since
        the last read are written now (a decode step that reads none, at batch 1, costs no op for them)."""
        if self._pending_positions:
            pending, end = self._pending_positions, self.logical_length
            known = self._positions
            shape = (*known.shape[:2], pending)
            if pending == 1:
                tail = torch.full(shape, end - 1, dtype=known.dtype, device=known.device)
            else:
                tail = torch.arange(end - pending, end, dtype=known.dtype, device=known.device).expand(shape)
            self._pending_positions = 0
            self._positions = torch.cat([known, tail], dim=2)
        return self._positions

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self._pending_positions = 0
        self._tail_run = 0
        self._positions = value

    @property
    def num_generated(self) -> int:
        return self.logical_length - self.prompt_length

    @property
    def valid_length(self) -> torch.Tensor:
        """LongTensor[B]: real (non-padding) tokens seen per row."""
        return self.logical_length - self.row_start

    def row_starts(self) -> list[int]:
        """First real column of each row, as Python ints (read from `row_start` only for a store the
        cache did not fill, such as a test's)."""
        return self.row_start_host if self.row_start_host is not None else self.row_start.tolist()

    def valid_lengths(self) -> list[int]:
        """Real (non-padding) tokens seen per row, as Python ints."""
        return [self.logical_length - start for start in self.row_starts()]

    def protected_counts(self) -> list[int]:
        """Protected (prompt) slots per (row, head), per row: the row's real prompt tokens, never evicted."""
        if not self.settings.protect_prompt:
            return [0] * len(self.slot_counts)
        return [max(0, self.prompt_length - start) for start in self.row_starts()]

    def evictable_counts(self) -> list[int]:
        """Valid, unprotected slots per (row, head), per row (host `num_evictable`)."""
        return [n - p for n, p in zip(self.slot_counts, self.protected_counts(), strict=True)]

    def _early_ends(self) -> list[int]:
        """Per row, the end of the forced early region (the sink, and the prompt when protected)."""
        end, protect = self.logical_length, self.settings.protect_prompt
        return [
            min(max(start + self.sink, self.prompt_length) if protect else start + self.sink, end)
            for start in self.row_starts()
        ]

    def forced_ends(self) -> tuple[int, int] | None:
        """(e, w), host ints: the forced set is the first e and the last w slots of every (row, head),
        when the store has no empty slot and its rows start alike (positions ascend in each (row, head),
        and no forced column was ever evicted); None otherwise, or when the two ranges meet."""
        starts = self.row_start_host
        if not self.all_valid or self.head_counts is not None or starts is None or len(set(starts)) != 1:
            return None
        end = self.logical_length
        early, late = self._early_ends()[0] - starts[0], end - max(end - self.window, starts[0])
        return (early, late) if early + late <= self.slot_counts[0] else None

    def forced_counts(self) -> list[int]:
        """Slots of `forced_keep()` per (row, head), per row, from host ints.

        The forced set of a row is its real columns in [row_start, early_end) and the last `window`
        columns. Every such column is still stored: it was forced at every compaction since it
        arrived (the early region never shrinks, the window only slides forward)."""
        end, counts = self.logical_length, []
        for start, early_end in zip(self.row_starts(), self._early_ends(), strict=True):
            late = max(end - self.window, start)
            counts.append(max(0, early_end - start) + (end - late) - max(0, early_end - late))
        return counts

    def budget_counts(self) -> list[int] | None:
        """`budget` as Python ints per row (None: no budget); the same rounding as the tensor."""
        spec = self.settings.budget
        if spec is None:
            return None
        if isinstance(spec, float):
            return [round(spec * n) + self.sink + self.window for n in self.valid_lengths()]
        return [int(spec)] * len(self.slot_counts)

    @property
    def budget(self) -> torch.Tensor | None:
        """LongTensor[B]: evictable tokens allowed per (row, head), or None (no budget)."""
        spec = self.settings.budget
        if spec is None:
            return None
        if isinstance(spec, float):
            return torch.round(spec * self.valid_length.double()).long() + self.sink + self.window
        return torch.full_like(self.row_start, int(spec))

    def valid(self) -> torch.Tensor:
        if self._valid is None:
            self._valid = self.positions >= 0
        return self._valid

    def protected(self) -> torch.Tensor:
        if not self.settings.protect_prompt:
            return torch.zeros_like(self.positions, dtype=torch.bool)
        return self.valid() & (self.positions < self.prompt_length)

    def evictable(self) -> torch.Tensor:
        return self.valid() & ~self.protected()

    def num_evictable(self) -> torch.Tensor:
        return self.evictable().sum(-1)

    def forced_keep(self) -> torch.Tensor:
        # computed once per store state: should_compress, select and the cache all ask for it
        if self._forced is None:
            # the prompt (when protected) and the sink are both a prefix of the row: one threshold
            early_end = self.row_start + self.sink
            if self.settings.protect_prompt:
                early_end = early_end.clamp(min=self.prompt_length)
            pos = self.positions
            early = pos < early_end[:, None, None]
            self._forced = self.valid() & (early | (pos >= self.logical_length - self.window))
        return self._forced

    def query_valid(self) -> torch.Tensor:
        return self.query_positions[None, :] >= self.row_start[:, None]

    def slot_buffer(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Per-slot tensor [B, H_c, K] kept aligned with the slots (see rlkv/policies/base.py)."""
        if name not in self._slot_buffers:
            buf = torch.full(self.positions.shape, fill, dtype=dtype, device=self.positions.device)
            self._slot_buffers[name] = (buf, fill)
        return self._slot_buffers[name][0]

    # what the cache does -----------------------------------------------------------------
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add the new tokens' keys/values [B, H_c, Q, D]; their slots get positions T..T+Q-1
        (int32 while positions fit, int64 beyond 2**31 tokens: `position_dtype`)."""
        batch, heads, q_len, _ = keys.shape
        run = self._tail_run
        dtype = position_dtype(self.logical_length + q_len)
        if self._positions is not None and self._positions.dtype != dtype:  # past 2**31 tokens: widen once
            self.positions = self.positions.to(dtype)
            self._capacity.pop("positions", None)
        if self.keys is None:
            self.evicted = torch.zeros(batch, dtype=torch.long, device=keys.device)
        if self.keys is not None and not grows_in_place(self.keys):
            # a small store (most compressed heads): one exactly sized `cat` per tensor, straight here
            # (no storage behind them to remember), positions when read: the hot path of a decode step
            if self._capacity:
                self._capacity.clear()
            self.keys = append_along_tokens(None, self.keys, keys, in_place=False)
            self.values = append_along_tokens(None, self.values, values, in_place=False)
            self._pending_positions += q_len
            for name, (buf, fill) in self._slot_buffers.items():
                pad = torch.full((batch, heads, q_len), fill, dtype=buf.dtype, device=buf.device)
                self._slot_buffers[name] = (append_along_tokens(None, buf, pad, in_place=False), fill)
        else:
            start = self.logical_length
            if q_len == 1:  # a decode step: one op
                new_pos = torch.full((batch, heads, 1), start, device=keys.device, dtype=dtype)
            else:
                new_pos = torch.arange(start, start + q_len, device=keys.device, dtype=dtype).expand(
                    batch, heads, q_len
                )
            self.keys = self._append("keys", self.keys, keys)
            self.values = self._append("values", self.values, values)
            self.positions = self._append("positions", self.positions, new_pos)
            for name, (buf, fill) in self._slot_buffers.items():
                pad = torch.full((batch, heads, q_len), fill, dtype=buf.dtype, device=buf.device)
                self._slot_buffers[name] = (self._append(f"slot:{name}", buf, pad), fill)
        self._tail_run = run + q_len  # positions T..T+Q-1 follow the run, which ended at T - 1
        self.logical_length += q_len
        self.slot_counts = [n + q_len for n in self.slot_counts] if self.slot_counts else [q_len] * batch
        if self.head_counts is not None:
            self.head_counts = [[n + q_len for n in row] for row in self.head_counts]
        if not self.evicted_host:
            self.evicted_host = [0] * batch
        self._slots_changed()

    def _append(self, name: str, current: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        storage = append_along_tokens(self._capacity.get(name), current, new)
        self._capacity[name] = storage
        return token_prefix(storage, new.shape[2] + (0 if current is None else current.shape[2]))

    def mark_padding(self, new_valid: torch.Tensor, padding: list[int] | None = None) -> None:
        """Set the slots of this forward's tokens that are padding (new_valid BoolTensor[B, Q] False) empty.

        padding: padding tokens of this forward per row, as Python ints (None: counted here, one read).
        """
        q_len = new_valid.shape[1]
        if padding is None:
            padding = (q_len - new_valid.sum(1)).tolist()
        tail = self.positions[:, :, -q_len:]
        self.positions[:, :, -q_len:] = torch.where(new_valid[:, None, :], tail, torch.full_like(tail, -1))
        self.slot_counts = [n - p for n, p in zip(self.slot_counts, padding, strict=True)]
        if self.head_counts is not None:
            self.head_counts = [
                [n - p for n in row] for row, p in zip(self.head_counts, padding, strict=True)
            ]
        self.all_valid = False
        self._tail_run = 0
        self._slots_changed()

    def drop_padding(self) -> None:
        """Free the slots `mark_padding` emptied, into exactly sized tensors (a prompt forward's padding
        never occupies memory or budget). Rows padded alike (left padding) lose the same leading
        columns: the suffix is copied as is."""
        if self.uniform:  # the host counts already exclude the padding (mark_padding)
            self._take_ends(0, self.slot_counts[0])
            self.all_valid = True
            self._capacity.clear()
            self._slots_changed()
        else:
            self.compact(self.valid(), list(self.slot_counts))

    def tensors(self) -> list[torch.Tensor | None]:
        """Every tensor the store holds (for resident-byte accounting)."""
        extra = [buf for buf, _ in self._slot_buffers.values()]
        extra += [t for t in self.state.values() if isinstance(t, torch.Tensor)]
        window = [self.query_ring.ring, self._queries, self._query_positions]
        kv = [self.keys, self.values, self._positions, *window, *extra]  # pending positions hold no bytes
        return [*kv, self.row_start, self.evicted]
