"""How a `CompressedStore` (rlkv/cache/store.py) drops slots: the kept slots gathered into new, exactly sized
tensors, in position order, the host counts of kept and evicted slots updated without reading the device.

`StoreCompaction` is the store's compaction half (a mixin: it reads and replaces the store's tensors,
host counts and spare-capacity views). Which path a compaction takes (docs/design.md, "Eviction"):
every (row, head) keeping the same count gathers whole rows by `torch.nonzero_static`; differing counts
sort the kept slots first (the missing ones empty); a store whose rows hold the same positions and a
policy that keeps by position (`compact_ends`) copies two column ranges, no index at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlkv.cache.growth import grows_in_place


class StoreCompaction:
    """The compaction methods of `CompressedStore` (see the module docstring)."""

    def compact_ends(self, kept: list[int]) -> None:
        """Keep each row's early region (sink, protected prompt) and its newest slots, `kept` per (row,
        head) in all, when every (row, head) holds the same positions and no empty slot (`uniform`):
        one `torch.cat` of two column ranges per tensor, no keep mask built (streaming, sink + recent).

        Once the kept newest slots all lie in the run of consecutive newest positions (a window of decode
        tokens) of a small store (appends by `cat`), their positions stay deferred (written when
        `positions` is read) and the early region's are one exactly sized tensor kept from step to step:
        no positions op in such a step."""
        early = self._early_ends()[0] - self.row_starts()[0]
        recent = kept[0] - early
        known = None if self._positions is None else self._positions.shape[2]
        # a store that appends into spare capacity writes each step's positions there anyway (`append`)
        small = not grows_in_place(self.keys)
        deferred = small and recent <= self._tail_run and known is not None and early <= known
        run = min(self._tail_run, recent)
        self._count_uniform_eviction(kept)
        if deferred:
            head = self._positions if known == early else self._positions[:, :, :early].clone()
            self._take_ends(early, kept[0], positions=False)
            self._positions, self._pending_positions = head, recent
        else:
            self._take_ends(early, kept[0])
        self._tail_run = run
        self._capacity.clear()
        self._slots_changed()

    def compact(self, keep: torch.Tensor, kept: list[int] | None = None) -> None:
        """Keep the slots where `keep` [B, H_c, K] is True (valid ones only), in exactly sized new tensors.

        kept: how many slots each row keeps per head, as Python ints (the policy's `kept_counts`):
        the gather then never reads `keep` on the host. None: count `keep` (one host read, for
        policies that declare no counts).

        Kept slots stay in position order. Fast paths (besides `compact_ends`, which needs no mask):
        when the keep mask is read (`kept` None) and every (row, head) keeps the same slots, whole
        columns are copied with one `index_select` per tensor; when every (row, head) keeps the same
        count, the kept slots are copied as rows with `index_select`, several times faster on CPU than
        the padded path's gather.
        """
        valid = self.valid()
        keep = keep & valid
        self.evicted += (valid > keep).sum(dim=(1, 2))  # valid and not kept: on the device, no read
        same_columns = self._recount(keep, kept)
        kept = self.slot_counts
        size = max(kept, default=0)
        equal_counts = self.head_counts is None and min(kept, default=0) == size
        if same_columns and keep.numel():
            self._take_columns(keep[0, 0].nonzero().view(-1))  # `keep` was read anyway
        elif equal_counts:
            self._take_slots(keep, size)
            self.uniform = False
        else:
            self._gather_padded(keep, size)
            self.uniform = False
        self.all_valid = equal_counts
        self._capacity.clear()  # the new tensors are exactly sized; the old storages are freed
        self._slots_changed()

    def _recount(self, keep: torch.Tensor, kept: list[int] | None) -> bool:
        """Update the host counts for a compaction to `keep` (valid slots only) keeping `kept` slots per
        row and head (None: count `keep`, one host read); returns whether whole columns suffice."""
        heads = keep.shape[1]
        if kept is not None:
            self._recount_counts(kept, heads)
            return False
        # the policy declares no counts: read them (and whether columns suffice)
        before = self.head_counts or [[n] * heads for n in self.slot_counts]
        per_head = keep.sum(-1).tolist()
        self.head_counts = per_head if any(min(row) != max(row) for row in per_head) else None
        self._count_evicted(before, per_head)
        self.slot_counts = [max(row, default=0) for row in per_head]
        return self.all_valid and torch.equal(keep, keep[:1, :1].expand_as(keep))

    def _count_uniform_eviction(self, kept: list[int]) -> None:
        """Device and host counts for a compaction of a store with no empty slot to `kept[b]` slots in
        every head of row b (the same count in every row: `compact_ends`, `compact_slots`)."""
        heads, slots = self.keys.shape[1:3]  # the keys' shape: reading `positions` would write deferred ones
        self.evicted += heads * (slots - kept[0])
        self._recount_counts(kept, heads)

    def _recount_counts(self, kept: list[int], heads: int) -> None:
        """Host counts after a compaction keeping `kept[b]` slots in every head of row b."""
        before = self.head_counts or [[n] * heads for n in self.slot_counts]
        self.head_counts = None
        self._count_evicted(before, [[n] * heads for n in kept])
        self.slot_counts = list(kept)

    def _count_evicted(self, before: list[list[int]], after: list[list[int]]) -> None:
        self.evicted_host = [
            e + sum(old) - sum(new) for e, old, new in zip(self.evicted_host, before, after, strict=True)
        ]

    def _take_ends(self, early: int, size: int, positions: bool = True) -> None:
        """Compact every (row, head) to its first `early` and last `size - early` slots (none empty):
        one `torch.cat` of two column ranges per tensor, into exactly sized new tensors (the positions
        left to the caller when `positions` is False)."""
        slots = self.keys.shape[2]
        recent = size - early

        def ends(t: torch.Tensor) -> torch.Tensor:
            return torch.cat([t[:, :, :early], t[:, :, slots - recent :]], dim=2)

        self.keys, self.values = ends(self.keys), ends(self.values)
        if positions:
            self.positions = ends(self.positions)
        for name, (buf, fill) in self._slot_buffers.items():
            self._slot_buffers[name] = (ends(buf), fill)

    def _take_columns(self, columns: torch.Tensor) -> None:
        """Compact when every (row, head) keeps the slots `columns` (LongTensor[N], in order), none empty."""
        self.keys = self.keys.index_select(2, columns)
        self.values = self.values.index_select(2, columns)
        self.positions = self.positions.index_select(2, columns)
        for name, (buf, fill) in self._slot_buffers.items():
            self._slot_buffers[name] = (buf.index_select(2, columns), fill)

    def _slots_changed(self) -> None:
        """Forget valid() and forced_keep(): the slots or their positions changed."""
        self._valid = self._forced = None

    def _take_slots(self, keep: torch.Tensor, size: int) -> None:
        """Compact when every (row, head) keeps `size` slots: [row * head, slot] indices, in order."""
        # [N, 2] (row * head, slot) in order; N is known, so no host read of the mask
        kept = torch.nonzero_static(keep.flatten(0, 1), size=keep.shape[0] * keep.shape[1] * size)
        self._select_rows(size, lambda stride: kept[:, 0] * stride + kept[:, 1])

    def compact_slots(self, slots: torch.Tensor) -> None:
        """Keep the slots `slots` (LongTensor[B, H_c, n], ascending in every (row, head)) of a store with
        no empty slot, in exactly sized new tensors (`rlkv.policies.base.select_top_scores` gives them:
        no keep mask to build or read)."""
        batch, heads, size = slots.shape
        self._count_uniform_eviction([size] * batch)
        first = torch.arange(batch * heads, device=slots.device)[:, None]
        flat = slots.reshape(batch * heads, size)
        self._select_rows(size, lambda stride: (first * stride + flat).view(-1))
        self.uniform = False
        self._capacity.clear()
        self._slots_changed()

    def _select_rows(self, size: int, row_index: Callable[[int], torch.Tensor]) -> None:
        """Copy `size` slots per (row, head) of every tensor by flat row index: `row_index(stride)` gives
        the LongTensor[B * H_c * size] of (row * head) * stride + slot for storages `stride` slots long."""
        rows: dict[int, torch.Tensor] = {}  # per storage length (shared by most tensors)

        def take(name: str, current: torch.Tensor) -> torch.Tensor:
            # read the storage `current` is a prefix view of (rows `capacity` slots apart), not a copy
            storage = self._capacity.get(name, current).contiguous()
            stride = storage.shape[2]
            if stride not in rows:
                rows[stride] = row_index(stride)
            taken = storage.flatten(0, 2).index_select(0, rows[stride])
            return taken.view(*current.shape[:2], size, *current.shape[3:])

        self.keys, self.values = take("keys", self.keys), take("values", self.values)
        self.positions = take("positions", self.positions)
        for name, (buf, fill) in self._slot_buffers.items():
            self._slot_buffers[name] = (take(f"slot:{name}", buf), fill)

    def _gather_padded(self, keep: torch.Tensor, size: int) -> None:
        """Compact when (row, head) counts differ: `size` slots each, the missing ones empty (-1)."""
        # stable sort: kept slots first, in their current order
        order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :size]
        filled = keep.gather(-1, order)
        idx = order[..., None].expand(-1, -1, -1, self.keys.shape[-1])
        self.keys = self.keys.gather(2, idx)
        self.values = self.values.gather(2, idx)
        self.positions = torch.where(filled, self.positions.gather(2, order), -1)
        for name, (buf, fill) in self._slot_buffers.items():
            self._slot_buffers[name] = (buf.gather(2, order), fill)
