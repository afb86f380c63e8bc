"""`StaticHeadMixedLayer`: one layer of a `StaticHeadMixedCache` (rlkv/cache/static/cache.py).

Full heads `[B, H_full, max_cache_len, D]`, compressed heads `[B, H_c, early + region, D]` slots
with int32 positions (rlkv/cache/static/slots.py), all allocated once per (batch, prompt width)
and written in place. `update` writes a decode token with device indices only; `attend` runs
the prefill's SDPA eagerly and a decode step as two SDPA calls (full heads, compressed heads), the
methods of `StaticLayerAttention` (rlkv/cache/static/attention.py).
The layer registers itself with the "rlkv_cache" attention function (SELF_ATTENDING_LAYERS).
"""

from __future__ import annotations

import functools

import torch
from transformers.cache_utils import CacheLayerMixin

from rlkv.cache.attention import SELF_ATTENDING_LAYERS
from rlkv.cache.head_index import head_indices, pick_heads
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.static.attention import StaticLayerAttention
from rlkv.cache.static.budget import (
    RowSchedule,
    StaticCacheError,
    StaticForm,
    dynamic_order,
    keep_in_run,
    keep_region,
    policy_view,
    unpadded_run,
)
from rlkv.cache.static.slots import (
    flush_positions,
    write_budget,
    write_streaming,
)
from rlkv.compat import mark_static_address


class _SlotBuffers:
    """What `CompressionPolicy.on_attention` may call on a static layer: `slot_buffer`, its per-slot
    buffers [B, H_c, S] in the layer's `buffers` (static addresses), created at the first (eager) call."""

    def __init__(self, layer: StaticHeadMixedLayer) -> None:
        self.layer = layer

    def slot_buffer(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        b, key = self.layer.buffers, f"slot:{name}"
        if key not in b:
            if torch.compiler.is_compiling():
                raise StaticCacheError(f"slot buffer {name!r} first asked for inside a compiled step")
            with torch.inference_mode(False):
                b[key] = torch.full(b["comp_pos"].shape, fill, dtype=dtype, device=b["comp_pos"].device)
            mark_static_address(b[key])
            self.layer.slot_fills[key] = fill
        return b[key]


class StaticHeadMixedLayer(StaticLayerAttention, CacheLayerMixin):
    """One layer of a `StaticHeadMixedCache` (see the module docstring for the layout)."""

    is_sliding = False
    is_compileable = True
    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        full_heads: torch.Tensor,
        num_groups: int,
        settings: CompressionSettings,
        form: StaticForm,
        max_cache_len: int,
        prompt_capacity: int = 0,
        shared: dict | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx, self.num_groups, self.settings, self.form = layer_idx, int(num_groups), settings, form
        self.num_kv_heads = int(full_heads.numel())
        self.max_cache_len = int(max_cache_len)
        self.prompt_capacity = int(prompt_capacity)  # prompt columns the early region is first sized for
        self.full_idx, self.full_slice = head_indices(full_heads)
        self.comp_idx, self.comp_slice = head_indices(~full_heads)
        self.full_q, self.full_q_slice = head_indices(full_heads, self.num_groups)
        self.comp_q, self.comp_q_slice = head_indices(~full_heads, self.num_groups)
        self.buffers: dict[str, torch.Tensor] = {}
        self.slot_fills: dict[str, float] = {}  # the policy's per-slot buffers in `buffers`, and their fills
        self.slot_view = _SlotBuffers(self)
        self.early = 0  # slots of the early region (host int; shapes depend on it)
        self.host_length = 0  # tokens stored, known on the host (decode indices use `length`)
        self.prompt_width = 0
        self.begun = False  # the step hook already did this forward's bookkeeping
        self.in_flight = 0  # tokens of a begun forward not yet written: get_seq_length excludes them
        self.compacted_at = -1
        self.defer_positions = False  # eager budget writes of unpadded rows leave positions to later
        self.deferred: tuple[int, int, int] | None = None  # (first slot, its column, count) not yet written
        # streaming: the first column no row's sink reaches (an eager step then writes its ring slot alone)
        self.sink_until = self.max_cache_len
        self.schedule: RowSchedule | None = None  # a budget region's compactions (set at prefill)
        # the `region_base` offset every row shares (eager writes use it), None when rows differ
        self.shared_offset: int | None = 0
        # what the cache's layers share: the schedule ("schedule") and the rows' starts ("row_starts"), made
        # by the layer "owner" at each prefill
        # (every compressed layer holds the same tokens, so one replay of the policy's rule serves all)
        self.shared = shared if shared is not None else {"owner": layer_idx}
        self.policy_state: dict = {}  # the policy's per-layer state across compactions (`store.state`)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the prompt's key/value, until attend

    # allocation and host bookkeeping (eager) ---------------------------------------------------
    def early_needed(self, width: int) -> int:
        """Early-region slots a prompt of `width` columns needs (its protected prompt or its sink)."""
        if self.form.kind == "budget":
            return width  # the protected prompt
        return max(self.settings.sink, width) if self.settings.protect_prompt else self.settings.sink

    def allocate(self, key_states: torch.Tensor, width: int) -> None:
        """Allocate (or keep, when they fit this request) the static tensors for batch B and prompt `width`."""
        batch, _, _, dim = key_states.shape
        needed = self.early_needed(width) if self.comp_idx.numel() else 0
        same = self.is_initialized and self.batch == batch and self.early >= needed
        if same and self.dtype == key_states.dtype and self.device == key_states.device:
            return
        if needed:  # sized for the widest prompt expected, so a wider later one keeps these tensors
            needed = self.early_needed(max(width, self.prompt_capacity))
        self.dtype, self.device, self.batch, self.early = key_states.dtype, key_states.device, batch, needed
        with torch.inference_mode(False):  # normal tensors: a later request may run outside inference mode
            self.buffers = self._new_buffers(batch, dim)
        self.slot_fills = {}  # created again at the next prefill
        for t in self.buffers.values():
            mark_static_address(t)  # fixed addresses: CUDA graphs replay on them
        for i in ("full_idx", "comp_idx", "full_q", "comp_q"):
            setattr(self, i, getattr(self, i).to(self.device))
        self.is_initialized = True

    def _new_buffers(self, batch: int, dim: int) -> dict[str, torch.Tensor]:
        new = functools.partial(torch.zeros, device=self.device)
        bufs = {"row_start": new(batch, dtype=torch.long), "region_base": new(batch, dtype=torch.long)}
        for name in ("length", "prompt_len", "early_offset"):
            bufs[name] = new((), dtype=torch.long)
        h_full, h_comp = self.full_idx.numel(), self.comp_idx.numel()
        if h_full:
            bufs["full_k"] = new(batch, h_full, self.max_cache_len, dim, dtype=self.dtype)
            bufs["full_v"] = new(batch, h_full, self.max_cache_len, dim, dtype=self.dtype)
        if h_comp:
            slots = self.early + self.form.region_slots(self.settings.window)
            bufs["comp_k"] = new(batch, h_comp, slots, dim, dtype=self.dtype)
            bufs["comp_v"] = new(batch, h_comp, slots, dim, dtype=self.dtype)
            bufs["comp_pos"] = torch.full((batch, h_comp, slots), -1, dtype=torch.int32, device=self.device)
            bufs["early_len"] = new(batch, dtype=torch.long)
            if self.form.observe:
                bufs["obs_q"] = new(batch, h_comp, self.num_groups, self.form.observe, dim, dtype=self.dtype)
        return bufs

    def begin(self, q_len: int) -> None:
        """Host bookkeeping before a forward of `q_len` tokens: checks, a due compaction, the host length."""
        if self.host_length and q_len > 1:
            raise StaticCacheError(
                f"a {q_len}-token forward reached a StaticHeadMixedCache holding {self.host_length} tokens: "
                "the static cache takes the prompt in one forward, then one token per step (call "
                "cache.reset() before a new request; chunked prefill needs static_cache=False)"
            )
        if self.host_length + q_len > self.max_cache_len:
            raise StaticCacheError(
                f"{self.host_length + q_len} tokens exceed max_cache_len={self.max_cache_len}: make the "
                "cache with max_cache_len >= prompt length + max_new_tokens"
            )
        if not self.host_length:
            self.prompt_width = q_len
        elif self._due(self.host_length - self.prompt_width):
            self.compact()
        self.host_length += q_len
        self.in_flight = q_len

    def _due(self, generated: int) -> bool:
        return self.schedule is not None and self.schedule.due(generated)

    def compact(self) -> None:
        """Compact the budget region now, if due and not done at this length (between decode steps)."""
        length = self.host_length
        generated = length - self.prompt_width
        if self.compacted_at == length or not self._due(generated):
            return
        flush_positions(self)
        b = self.buffers
        slots = (b["comp_k"], b["comp_v"], b["comp_pos"])
        queries = None
        if self.form.observe:
            n = min(length, self.form.observe)
            held = torch.arange(length - n, length, device=self.device)  # oldest first
            queries = (b["obs_q"].index_select(3, held % self.form.observe), held)
        last = self.schedule.last_compaction(generated)
        base = self.early if self.form.protect else 0  # where the kept evictable tokens are packed
        slot_buffers = tuple((b[key], fill) for key, fill in self.slot_fills.items())
        run = unpadded_run(
            self.form, self.early, self.prompt_width, generated, last, self.shared["row_starts"]
        )
        if run is None:
            self._compact_in_dynamic_order(queries, last, base, slot_buffers)
        else:  # the slots the dynamic store lists are one run, already in its order: a view of them
            lo, hi = run
            view = policy_view(
                self.layer_idx,
                self.comp_idx,
                self.num_groups,
                self.settings,
                tuple(t.narrow(2, lo, hi - lo) for t in slots),
                queries,
                b["row_start"],
                (length, self.prompt_width),
                self.policy_state,
                unpadded=True,
            )
            for (buf, fill), key in zip(slot_buffers, self.slot_fills, strict=True):
                view._slot_buffers[key.removeprefix("slot:")] = (buf.narrow(2, lo, hi - lo), fill)
            skip = self.prompt_width if self.form.protect else 0  # the protected prompt stays put
            keep_in_run(view, self.settings.policy, slots, lo, skip, base, slot_buffers)
        # generated token g then goes to slot early + g + region_base[b]: right after the row's kept run
        offsets = [base + h - generated - self.early for h in self.schedule.held(generated)]
        b["region_base"].copy_(torch.tensor(offsets))  # host ints sent, nothing read
        self.shared_offset = offsets[0] if len(set(offsets)) == 1 else None
        self.compacted_at = length

    def _compact_in_dynamic_order(
        self,
        queries: tuple[torch.Tensor, torch.Tensor] | None,
        last: tuple[int, list[int]] | None,
        base: int,
        slot_buffers: tuple[tuple[torch.Tensor, float], ...],
    ) -> None:
        """The compaction of padded rows: the policy sees the slots gathered in the dynamic store's order."""
        b = self.buffers
        slots = (b["comp_k"], b["comp_v"], b["comp_pos"])
        region = self.form.region_slots(self.settings.window)
        generated = self.host_length - self.prompt_width
        at, kept = (0, None) if last is None else (last[0], torch.tensor(last[1], device=self.device))
        order = dynamic_order(
            b["row_start"], self.prompt_width, self.early, region, kept, generated - at, self.form.protect
        )
        gather = order[:, None, :].expand(-1, slots[2].shape[1], -1)

        def view_of(t: torch.Tensor, empty: float) -> torch.Tensor:
            """`t`'s slots in the dynamic order, an `empty` slot appended for what that store holds empty."""
            padded = torch.cat([t, t.new_full((*t.shape[:2], 1, *t.shape[3:]), empty)], 2)
            index = gather if t.dim() == 3 else gather[..., None].expand(-1, -1, -1, t.shape[-1])
            return padded.gather(2, index)

        view = policy_view(
            self.layer_idx,
            self.comp_idx,
            self.num_groups,
            self.settings,
            (view_of(slots[0], 0), view_of(slots[1], 0), view_of(slots[2], -1)),
            queries,
            b["row_start"],
            (self.host_length, self.prompt_width),
            self.policy_state,
        )
        for (buf, fill), key in zip(slot_buffers, self.slot_fills, strict=True):
            view._slot_buffers[key.removeprefix("slot:")] = (view_of(buf, fill), fill)
        keep_region(view, self.settings.policy.select(view), slots, order, base, slot_buffers)

    # CacheLayerMixin -------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.allocate(key_states, key_states.shape[2])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write the new tokens' key/value [B, H_kv, Q, D] in place; returns (self, self) for `attend`."""
        if not torch.compiler.is_compiling():  # transformers compiles decode steps only: prefill is here
            if self.begun:
                self.begun = False
            else:
                self.begin(key_states.shape[2])
            self.in_flight = 0
            if self.host_length == key_states.shape[2]:
                self.allocate(key_states, key_states.shape[2])
                self.pending = (key_states, value_states)
                return self, self
        else:
            # The host bookkeeping (a due compaction, the host length) runs outside the graph; a step
            # traced or replayed without it would write past the region (an out-of-bounds index on CPU,
            # a device assert or a silent wrong read on CUDA). Reading `begun` here makes dynamo guard
            # on it: a call without the bookkeeping fails the guard and the retrace raises, host side.
            if not self.begun:
                raise StaticCacheError(
                    "a compiled decode step reached a StaticHeadMixedCache without its host bookkeeping: "
                    "call cache.before_forward(1, input_ids) before each compiled forward you run yourself "
                    "(model.generate and rlkv.inference.generate do it for you)"
                )
            self.begun, self.in_flight = False, 0
        b = self.buffers
        pos = b["length"]  # this token's column; the counter moves on once it is written
        if self.full_idx.numel():
            at = pos.view(1)
            b["full_k"].index_copy_(2, at, pick_heads(key_states, self.full_idx, self.full_slice))
            b["full_v"].index_copy_(2, at, pick_heads(value_states, self.full_idx, self.full_slice))
        if self.comp_idx.numel():
            keys = pick_heads(key_states, self.comp_idx, self.comp_slice)
            values = pick_heads(value_states, self.comp_idx, self.comp_slice)
            if self.form.kind == "streaming":
                write_streaming(self, pos, keys, values)
            else:
                write_budget(self, pos, keys, values)
        b["length"].add_(1)
        return self, self

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def get_seq_length(self) -> int | torch.Tensor:
        # a traced forward must not read a host int (it would be baked in and recompiled every step)
        if torch.compiler.is_compiling():
            return self.buffers["length"]
        return self.host_length - self.in_flight  # the model sizes its mask before the tokens are written

    def get_max_length(self) -> int:
        return self.max_cache_len

    def reset(self) -> None:
        """Forget the request; the tensors stay allocated at the same addresses."""
        self.host_length = self.prompt_width = 0
        self.begun, self.in_flight, self.compacted_at, self.pending = False, 0, -1, None
        self.deferred = None
        self.sink_until = self.max_cache_len
        self.schedule = None
        self.shared_offset = 0
        if self.buffers:
            self.buffers["length"].zero_()
            self.buffers["region_base"].zero_()
            if "comp_pos" in self.buffers:
                self.buffers["comp_pos"].fill_(-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("StaticHeadMixedCache does not support beam search; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("StaticHeadMixedCache cannot be cropped: evicted tokens are gone")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("StaticHeadMixedCache does not support num_return_sequences > 1")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("StaticHeadMixedCache does not support selecting batch rows")

    # what the cache reports --------------------------------------------------------------------------
    def kept_positions(self) -> torch.Tensor | None:
        """Positions [B, H_c, S] (int64) of the compressed slots the dynamic cache also keeps now, -1 elsewhere
        (streaming: the ring slot the next token overwrites is dropped). None without compressed heads."""
        if not self.comp_idx.numel() or not self.buffers:
            return None
        self.compact()  # a compaction due before the next step (the dynamic cache did it after this one)
        flush_positions(self)
        pos = self.buffers["comp_pos"].long()
        if self.form.kind == "streaming":
            ring = pos[:, :, self.early :]
            pos = torch.cat(
                [
                    pos[:, :, : self.early],
                    ring.masked_fill(ring < self.host_length - self.settings.window, -1),
                ],
                2,
            )
        return pos

    def tensors(self) -> list[torch.Tensor]:
        return [*self.buffers.values(), self.full_idx, self.comp_idx, self.full_q, self.comp_q]


SELF_ATTENDING_LAYERS.append(StaticHeadMixedLayer)
