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
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from rlkv.vllm_plugin.fence import step_inputs
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
        # persistent, so that a captured graph reads this step's slots at fixed addresses
        self.ring_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)
        self.prompt_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> RingMetadata:
        m = common_attn_metadata
        reqs, tokens, device = m.num_reqs, m.slot_mapping.shape[0], m.block_table_tensor.device
        starts_cpu = m.query_start_loc_cpu[: reqs + 1]
        prefilling, upper, position = step_inputs(m)
        # a row of several queries that is not a prompt is a preempted request replaying its outputs: read
        # causally over its prompt blocks (vLLM's manager gave it blocks to its `prefill_end`)
        linear_cpu = prefilling | ((starts_cpu[1:] - starts_cpu[:-1]) > 1)
        linear = linear_cpu.to(device, non_blocking=True)
        upper = torch.where(linear_cpu, upper, upper.clamp(max=self.capacity))
        seq_lens = m.seq_lens[:reqs]
        table = m.block_table_tensor[:reqs]
        columns = table.shape[1] - self.ring_columns
        read_table = torch.where(linear[:, None], table[:, self.ring_columns :], table[:, :columns])

        token = torch.arange(tokens, device=device)
        request = torch.searchsorted(m.query_start_loc[1 : reqs + 1], token, right=True).clamp(max=reqs - 1)
        real = token < m.query_start_loc[reqs]
        position = position[:tokens]
        ring_index = torch.where(
            position < self.sink, position, self.sink + (position - self.sink) % (self.window + 1)
        )
        # a token a later token of the step overwrites in the ring is not written there (one write per slot)
        kept = (position < self.sink) | (position >= seq_lens[request] - (self.window + 1))
        ring = table[request, ring_index // self.block] * self.block + ring_index % self.block
        column = (self.ring_columns + position // self.block).clamp(max=table.shape[1] - 1)
        prompt = table[request, column] * self.block + position % self.block
        self.ring_slots[:tokens] = torch.where(real & kept, ring, -1)
        self.prompt_slots[:tokens] = torch.where(real & linear[request], prompt, -1)

        read = dataclasses.replace(
            m,
            seq_lens=torch.where(linear, seq_lens, seq_lens.clamp(max=self.capacity)),
            seq_lens_cpu_upper_bound=upper,
            max_seq_len=int(upper.max()),
            block_table_tensor=read_table,
            slot_mapping=self.prompt_slots[:tokens],
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )
        stock = super().build(0, read, fast_build)
        # the flags are host data: a decode-only step (every captured graph's) skips the prompt write
        prompt_slots = self.prompt_slots[:tokens] if bool(linear_cpu.any()) else None
        return RingMetadata(stock, self.ring_slots[:tokens], prompt_slots)


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
