"""The ring group's attention (`ring.py`): the platform's own backend, its tables and slots remapped per step.

Per step the metadata builder computes on the device, for every token, its ring slot and (a prompt token)
its prompt slot, and per request the table and length its queries read: a request computing its prompt
(or replaying it with its outputs after a preemption: any row of more than one query) reads its prompt
blocks, `seq_len` tokens, causally; a generating request reads its ring, `min(seq_len, sink + window + 1)`
slots. It then hands the platform builder the step's metadata with those tables and lengths, so the
platform's own metadata (CPU_ATTN's scheduler plan here) is built once per step for the group's layers.
Per layer the impl writes the step's keys and values with the platform's own cache write, once at the
ring slots and once at the prompt slots (a slot of -1 is skipped, as vLLM's padding), and runs the
platform's own attention kernel: two writes and one kernel call per layer, whatever the batch holds.

No host read of a device tensor: the host inputs are vLLM's host copies (query starts, prefill flags,
upper bounds of the lengths); the slots live in buffers sized once (`max_num_batched_tokens`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from vllm.config import get_layers_from_vllm_config
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from rlkv.vllm_plugin.fence import step_inputs
from rlkv.vllm_plugin.ring import RING_BACKENDS


@dataclass
class RingRows:
    """One step of the ring layers of `k` units (`head rows`): the platform backend's metadata over the rows'
    remapped tables and lengths, the slots [T * k] each row token is written to in the ring and in its prompt
    (-1: not written there; None: no token of the step is a prompt token, so no prompt write), and `order`
    [T * k], the token-major index (token t, unit h: t * k + h) of each row token (None: the same order, a
    step whose rows are single queries)."""

    stock: Any
    ring_slots: torch.Tensor
    prompt_slots: torch.Tensor | None
    order: torch.Tensor | None = None


@dataclass
class RingMetadata:
    """One step of the ring group: `RingRows` for each count of units its layers hold."""

    rows: dict[int, RingRows]


class RingBuilderMixin:
    """Before the platform's metadata builder: the step's ring and prompt slots, tables and read lengths, for
    each count of head units its layers hold (`head rows`: a request's k units are k rows of one call)."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names).values()
        self.row_counts = sorted({layer.rlkv_rows for layer in layers})
        # the platform's plan is per row: one unit's KV heads and their query heads
        (self.num_heads,) = {layer.num_heads // layer.rlkv_rows for layer in layers}
        self.units = kv_cache_spec.units
        self.sink, self.window = kv_cache_spec.sink, kv_cache_spec.window
        self.capacity, self.ring_columns = kv_cache_spec.ring_capacity, kv_cache_spec.ring_blocks
        self.block = kv_cache_spec.block_size
        tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        # persistent, so that a captured graph reads this step's slots at fixed addresses
        self.ring_slots = {
            k: torch.full((tokens * k,), -1, dtype=torch.int64, device=device) for k in self.row_counts
        }
        self.prompt_slots = {
            k: torch.full((tokens * k,), -1, dtype=torch.int64, device=device) for k in self.row_counts
        }
        self.protect = kv_cache_spec.protect_prompt
        if (
            self.protect
        ):  # each request's ring base (its prompt's end, or sink), on the device, by its first block
            blocks = int(vllm_config.cache_config.num_gpu_blocks)  # the pool's, set before builders are made
            self.bases = torch.zeros(blocks, dtype=torch.int64, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingMetadata:
        step = common_attn_metadata
        rows = {}
        for k in self.row_counts:
            m, order = _per_step(step, ("rows", k), lambda k=k: _head_rows(step, k))
            # the rows' tables are this group's (the rows themselves are the same in every group of the step)
            m = dataclasses.replace(m, block_table_tensor=_unit_tables(step, k, self.units))
            build = self._build_protected if self.protect else self._build_ring
            rows[k] = build(m, k, step, fast_build)
            rows[k].order = order
        return RingMetadata(rows)

    def _build_ring(self, m: CommonAttentionMetadata, k: int, step: Any, fast_build: bool) -> RingRows:
        """The eval form's ring (`ring.py`) for rows `m` (requests, or their units: `_head_rows`)."""
        reqs, tokens = m.num_reqs, m.slot_mapping.shape[0]
        key = ("plan", k, self.sink, self.window, self.block)
        plan = _per_step(step, key, lambda: _step_plan(m, self.sink, self.window, self.block))
        table = m.block_table_tensor[:reqs]
        ring = table[plan.request, plan.ring_column] * self.block + plan.ring_offset
        self.ring_slots[k][:tokens] = torch.where(plan.ring_kept, ring, -1)
        columns = table.shape[1] - self.ring_columns
        seq_lens = m.seq_lens[:reqs]
        if plan.linear is None:  # a decode-only step (every captured graph's): no prompt row, no prompt write
            prompt_slots, read_table, read_lens = None, table[:, :columns], seq_lens.clamp(max=self.capacity)
        else:
            column = (self.ring_columns + plan.prompt_column).clamp(max=table.shape[1] - 1)
            prompt = table[plan.request, column] * self.block + plan.prompt_offset
            self.prompt_slots[k][:tokens] = torch.where(plan.prompt_kept, prompt, -1)
            prompt_slots = self.prompt_slots[k][:tokens]
            read_table = torch.where(plan.linear[:, None], table[:, self.ring_columns :], table[:, :columns])
            read_lens = torch.where(plan.linear, seq_lens, seq_lens.clamp(max=self.capacity))
        read = dataclasses.replace(
            m,
            seq_lens=read_lens,
            seq_lens_cpu_upper_bound=plan.upper,
            max_seq_len=int(plan.upper.max()),
            block_table_tensor=read_table,
            slot_mapping=self.ring_slots[k][:tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return RingRows(super().build(0, read, fast_build), self.ring_slots[k][:tokens], prompt_slots)

    def _build_protected(self, m: CommonAttentionMetadata, k: int, step: Any, fast_build: bool) -> RingRows:
        """The protected layout (`ring.py`): a prompt row (or a replay) writes position p at slot p and reads
        causally; it sets its request's base to the row's end (at least sink), kept on the device by the
        request's first block (a block of its own for its life: this group shares none). A generated token
        at p >= base goes to slot base + (p - base) % (window + 1), and its query reads the first
        min(p + 1, base + window + 1) slots: one write and one stock call per layer."""
        reqs, tokens = m.num_reqs, m.slot_mapping.shape[0]
        linear_cpu, _, request, real, p = _rows_and_tokens(m)
        table, seq_lens = m.block_table_tensor[:reqs], m.seq_lens[:reqs]
        linear = linear_cpu.to(seq_lens.device, non_blocking=True)
        first = table[:, 0]
        base = torch.where(linear, seq_lens.clamp(min=self.sink), self.bases[first])
        self.bases[first] = base  # a step's requests are distinct: one write per first block
        b = base[request]
        index = torch.where(p < b, p, b + (p - b) % (self.window + 1))
        slots = table[request, index // self.block] * self.block + index % self.block
        self.ring_slots[k][:tokens] = torch.where(real, slots, -1)
        read = dataclasses.replace(
            m,
            seq_lens=torch.where(linear, seq_lens, torch.minimum(seq_lens, base + self.window + 1)).to(
                seq_lens.dtype
            ),
            slot_mapping=self.ring_slots[k][:tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return RingRows(super().build(0, read, fast_build), self.ring_slots[k][:tokens], None)


@dataclass
class _StepPlan:
    """What a step's tokens do in any ring group of the engine (the groups differ only in their block tables):
    per token [T] its request, its ring slot's column and offset and whether it is written there, its prompt
    slot's column (counted after the ring's columns) and offset and whether it is written there (None: no
    request of the step reads its prompt blocks); per request [R] whether it reads its prompt blocks and the
    host upper bound of the length it reads (its sequence, or at most the ring's slots)."""

    request: torch.Tensor
    ring_column: torch.Tensor
    ring_offset: torch.Tensor
    ring_kept: torch.Tensor
    prompt_column: torch.Tensor | None
    prompt_offset: torch.Tensor | None
    prompt_kept: torch.Tensor | None
    linear: torch.Tensor | None
    upper: torch.Tensor


# what the ring groups compute once per step (head rows, plans), for the last step: keyed by vLLM's host query
# starts of that step (one object shared by every group's metadata of a step, a new one each step: vLLM copies
# its per-step metadata shallowly for each group); the object is held, so its id is not reused meanwhile
_STEP: list[Any] = [None, {}]


def _per_step(step: CommonAttentionMetadata, key: tuple, make: Any) -> Any:
    """`make()` once per step and `key` (the first group of the step that needs it computes it)."""
    if _STEP[0] is not step.query_start_loc_cpu:
        _STEP[:] = [step.query_start_loc_cpu, {}]
    if key not in _STEP[1]:
        _STEP[1][key] = make()
    return _STEP[1][key]


def _unit_tables(m: CommonAttentionMetadata, k: int, units: int) -> torch.Tensor:
    """The block table [R * k, J] of the step's head rows (`_head_rows`) in a group whose requests' tables hold
    `units` units: row (r, h) is the columns `h::units` of request r's table."""
    table = m.block_table_tensor[: m.num_reqs]
    if units == 1:
        return table
    columns = table.shape[1] // units
    table = table[:, : columns * units].view(table.shape[0], columns, units)[:, :, :k].transpose(1, 2)
    return table.reshape(-1, columns).contiguous()  # the kernel reads a table's columns at stride 1


def _head_rows(m: CommonAttentionMetadata, k: int) -> tuple[CommonAttentionMetadata, Any]:
    """The step `m` with each request's `k` head units as `k` rows of their own (row (r, h): request r's unit h,
    its queries and its sequence length; its table is `_unit_tables`'): the metadata of those rows, and `order`
    [T * k], the token-major index (t * k + h) of each row token in row order (None when every row is a single
    query: then row order is token-major order). Padding tokens keep their place."""
    if k == 1:
        return m, None
    reqs, tokens = m.num_reqs, m.slot_mapping.shape[0]
    device = m.block_table_tensor.device
    prefilling, upper, position = step_inputs(m)
    starts, starts_cpu = m.query_start_loc[: reqs + 1], m.query_start_loc_cpu[: reqs + 1]
    units_cpu, unit = torch.arange(k), torch.arange(k, device=device)
    lens, lens_cpu = starts[1:] - starts[:-1], starts_cpu[1:] - starts_cpu[:-1]
    row_starts = torch.cat([(starts[:-1, None] * k + unit * lens[:, None]).flatten(), starts[-1:] * k])
    row_starts_cpu = torch.cat(
        [(starts_cpu[:-1, None] * k + units_cpu * lens_cpu[:, None]).flatten(), starts_cpu[-1:] * k]
    )
    row_position = position[:tokens].repeat_interleave(k)  # token-major: token t's units at t * k + h
    if int(lens_cpu.max()) <= 1:
        order = None
    else:
        token = torch.arange(tokens, device=device)
        request = torch.searchsorted(starts[1:], token, right=True).clamp(max=reqs - 1)
        first = starts[request]
        row = (first * k + (token - first))[:, None] + unit * lens[request][:, None]
        row = torch.where((token < starts[-1])[:, None], row, token[:, None] * k + unit).flatten()
        order = torch.empty_like(row)
        order[row] = torch.arange(tokens * k, device=device)
        row_position = row_position[order]
    rows = dataclasses.replace(
        m,
        query_start_loc=row_starts.to(starts.dtype),
        query_start_loc_cpu=row_starts_cpu.to(starts_cpu.dtype),
        seq_lens=m.seq_lens[:reqs].repeat_interleave(k),
        seq_lens_cpu_upper_bound=upper.repeat_interleave(k),
        is_prefilling=prefilling.repeat_interleave(k),
        positions=row_position,
        num_reqs=reqs * k,
        num_actual_tokens=m.num_actual_tokens * k,
        slot_mapping=m.slot_mapping.new_empty(tokens * k),
        _num_computed_tokens_cache=None,
        _token_to_req_indices_cache=None,
    )
    return rows, order


def _rows_and_tokens(
    m: CommonAttentionMetadata,
) -> tuple[torch.Tensor, ...]:
    """(linear [R] host bool: the request's row reads its prompt blocks causally, the host upper bounds of the
    sequence lengths [R], each token's request [T],
    whether each token is real (not padding) [T], positions [T]) of one step, for either ring layout. A row of
    several queries that is not a prompt is a preempted request replaying its outputs: read as prompt."""
    reqs, tokens = m.num_reqs, m.slot_mapping.shape[0]
    starts_cpu = m.query_start_loc_cpu[: reqs + 1]
    prefilling, upper, position = step_inputs(m)
    linear_cpu = prefilling | ((starts_cpu[1:] - starts_cpu[:-1]) > 1)
    token = torch.arange(tokens, device=m.block_table_tensor.device)
    request = torch.searchsorted(m.query_start_loc[1 : reqs + 1], token, right=True).clamp(max=reqs - 1)
    return linear_cpu, upper, request, token < m.query_start_loc[reqs], position[:tokens]


def _step_plan(m: CommonAttentionMetadata, sink: int, window: int, block: int) -> _StepPlan:
    """The step's `_StepPlan` for ring groups of this form over rows `m` (built once per step, `_per_step`)."""
    device = m.block_table_tensor.device
    # a replaying row reads causally over its prompt blocks (its manager gave it blocks to the row's end)
    linear_cpu, upper, request, real, position = _rows_and_tokens(m)
    any_linear = bool(linear_cpu.any())
    ring_index = torch.where(position < sink, position, sink + (position - sink) % (window + 1))
    # a token a later token of the step overwrites in the ring is not written there (one write per slot)
    kept = real & ((position < sink) | (position >= m.seq_lens[request] - (window + 1)))
    linear = linear_cpu.to(device, non_blocking=True) if any_linear else None
    read = upper.clamp(max=sink + window + 1)
    plan = _StepPlan(
        request=request,
        ring_column=ring_index // block,
        ring_offset=ring_index % block,
        ring_kept=kept,
        prompt_column=position // block if linear is not None else None,
        prompt_offset=position % block if linear is not None else None,
        prompt_kept=real & linear[request] if linear is not None else None,
        linear=linear,
        upper=torch.where(linear_cpu, upper, read) if linear is not None else read,
    )
    return plan


class RingImplMixin:
    """Before the platform's attention impl: writes a step's keys and values at their ring and prompt slots,
    then runs the platform's kernel on the remapped metadata."""

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: RingMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of query [T, H_q, D] into output; key, value [T, H_kv, D] are written first. The layer's
        k head units are k rows per request (`_head_rows`): token-major [T, k * h, D] is [T * k, h, D], a view
        when the step's rows are single queries, else reordered to rows and the output back."""
        if attn_metadata is None:  # profiling run
            return output
        k = layer.rlkv_rows
        m = attn_metadata.rows[k]
        tokens = m.ring_slots.shape[0] // k
        size = query.shape[-1]
        query = query[:tokens].reshape(tokens * k, -1, size)
        key = key[:tokens].reshape(tokens * k, -1, size)
        value = value[:tokens].reshape(tokens * k, -1, size)
        rows = target = output[:tokens].view(tokens * k, -1, size)
        if m.order is not None:
            query, key, value = query[m.order], key[m.order], value[m.order]
            rows = torch.empty_like(target)
        super().do_kv_cache_update(layer, key, value, kv_cache, m.ring_slots)
        if m.prompt_slots is not None:
            super().do_kv_cache_update(layer, key, value, kv_cache, m.prompt_slots)
        super().forward(layer, query, key, value, kv_cache, m.stock, rows, output_scale, output_block_scale)
        if m.order is not None:
            target.index_copy_(0, m.order, rows)
        return output


class CpuRingBuilder(RingBuilderMixin, CPUAttentionMetadataBuilder):
    """The ring's builder over vLLM's CPU attention builder."""


class CpuRingImpl(RingImplMixin, CPUAttentionBackendImpl):
    """The ring's impl over vLLM's CPU attention kernel."""


class CpuRingBackend(CPUAttentionBackend):
    """vLLM's CPU attention backend for rlkv's ring group (registered as `RING_BACKENDS["CPU_ATTN"]`)."""

    forward_includes_kv_cache_update: bool = True  # the impl writes, at slots of its own

    @staticmethod
    def get_name() -> str:
        return RING_BACKENDS["CPU_ATTN"][0]

    @staticmethod
    def get_impl_cls() -> type[CpuRingImpl]:
        return CpuRingImpl

    @staticmethod
    def get_builder_cls() -> type[CpuRingBuilder]:
        return CpuRingBuilder
