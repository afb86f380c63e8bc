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
upper bounds of the lengths); the slots, the lengths and (in a step with a prompt row) the tables the kernel reads
live in buffers made once (`max_num_batched_tokens`, `max_num_seqs`), so a captured graph finds them at fixed
addresses (the tests check both on the CPU: `test_ring_graph_readiness.py`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from rlkv.vllm_plugin.fence import step_inputs
from rlkv.vllm_plugin.persistent import PersistentReads
from rlkv.vllm_plugin.ring import RING_BACKENDS


@dataclass
class RingMetadata:
    """One step of the ring group: the platform backend's metadata over the remapped tables and lengths, and
    the slots [T] each token is written to in the ring and in its prompt (-1: not written there; None: no
    token of the step is a prompt token, so no prompt write)."""

    stock: Any
    ring_slots: torch.Tensor
    prompt_slots: torch.Tensor | None


class RingBuilderMixin:
    """Before the platform's metadata builder: the step's ring and prompt slots, tables and read lengths."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.sink, self.window = kv_cache_spec.sink, kv_cache_spec.window
        self.capacity, self.ring_columns = kv_cache_spec.ring_capacity, kv_cache_spec.ring_blocks
        self.block = kv_cache_spec.block_size
        tokens = int(vllm_config.scheduler_config.max_num_batched_tokens)
        requests = int(vllm_config.scheduler_config.max_num_seqs)
        # persistent, so that a captured graph reads this step's slots, lengths and tables at fixed addresses
        self.persistent = PersistentReads(requests, tokens, device)
        self.ring_slots = self.persistent.write_slots
        self.prompt_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.protect = kv_cache_spec.protect_prompt
        if (
            self.protect
        ):  # each request's ring base (its prompt's end, or sink), on the device, by its first block
            blocks = int(vllm_config.cache_config.num_gpu_blocks)  # the pool's, set before builders are made
            self.bases = torch.zeros(blocks, dtype=torch.int64, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingMetadata:
        read, ring_slots, prompt_slots = self.read_metadata(common_attn_metadata)
        return RingMetadata(super().build(0, read, fast_build), ring_slots, prompt_slots)

    def read_metadata(
        self, m: CommonAttentionMetadata
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor | None]:
        """(the step's metadata with the tables, lengths and write slots the platform kernel reads; ring slots
        [T]; prompt slots [T] or None), computed on the device from vLLM's device tensors and host copies (no
        host read of a device tensor); every tensor the kernel reads lies in a persistent buffer, vLLM's or
        this builder's."""
        if self.protect:
            return self._read_protected(m)
        reqs, tokens = m.num_reqs, m.slot_mapping.shape[0]
        plan = _step_plan(m, self.sink, self.window, self.block)
        table = m.block_table_tensor[:reqs]
        ring = table[plan.request, plan.ring_column] * self.block + plan.ring_offset
        self.ring_slots[:tokens] = torch.where(plan.ring_kept, ring, -1)
        columns = table.shape[1] - self.ring_columns
        seq_lens = m.seq_lens[:reqs]
        if plan.linear is None:  # a decode-only step (every captured graph's): no prompt row, no prompt write
            prompt_slots, read_table = None, table[:, :columns]  # a view of vLLM's persistent table
            read_lens = self.persistent.lengths(seq_lens.clamp(max=self.capacity))
        else:
            column = (self.ring_columns + plan.prompt_column).clamp(max=table.shape[1] - 1)
            prompt = table[plan.request, column] * self.block + plan.prompt_offset
            self.prompt_slots[:tokens] = torch.where(plan.prompt_kept, prompt, -1)
            prompt_slots = self.prompt_slots[:tokens]
            read_table = self.persistent.table(
                torch.where(plan.linear[:, None], table[:, self.ring_columns :], table[:, :columns])
            )
            read_lens = self.persistent.lengths(
                torch.where(plan.linear, seq_lens, seq_lens.clamp(max=self.capacity))
            )
        read = dataclasses.replace(
            m,
            seq_lens=read_lens,
            seq_lens_cpu_upper_bound=plan.upper,
            max_seq_len=int(plan.upper.max()),
            block_table_tensor=read_table,
            slot_mapping=self.ring_slots[:tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return read, self.ring_slots[:tokens], prompt_slots

    def _read_protected(
        self, m: CommonAttentionMetadata
    ) -> tuple[CommonAttentionMetadata, torch.Tensor, torch.Tensor | None]:
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
        self.ring_slots[:tokens] = torch.where(real, slots, -1)
        read = dataclasses.replace(
            m,
            seq_lens=self.persistent.lengths(
                torch.where(linear, seq_lens, torch.minimum(seq_lens, base + self.window + 1))
            ),
            slot_mapping=self.ring_slots[:tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        return read, self.ring_slots[:tokens], None


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


# the last step's plan, keyed by vLLM's host query starts of that step (one object shared by every group's
# metadata of a step, a new one each step: vLLM copies its per-step metadata shallowly for each group); the
# object is held, so its id is not reused while the entry lives
_LAST_PLAN: list[tuple[Any, tuple[int, int, int], _StepPlan]] = []


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
    """The step's `_StepPlan` for ring groups of this form, built by the step's first ring group."""
    if _LAST_PLAN and _LAST_PLAN[0][0] is m.query_start_loc_cpu and _LAST_PLAN[0][1] == (sink, window, block):
        return _LAST_PLAN[0][2]
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
    _LAST_PLAN[:] = [(m.query_start_loc_cpu, (sink, window, block), plan)]
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
        """Attention of query [T, H_q, D] into output; key, value [T, H_kv, D] are written first."""
        if attn_metadata is None:  # profiling run
            return output
        m = attn_metadata
        if key.shape[0] != m.ring_slots.shape[0]:
            key, value = key[: m.ring_slots.shape[0]], value[: m.ring_slots.shape[0]]
        super().do_kv_cache_update(layer, key, value, kv_cache, m.ring_slots)
        if m.prompt_slots is not None:
            super().do_kv_cache_update(layer, key, value, kv_cache, m.prompt_slots)
        return super().forward(
            layer, query, key, value, kv_cache, m.stock, output, output_scale, output_block_scale
        )


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
