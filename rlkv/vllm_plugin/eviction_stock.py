"""The eviction group on the platform's own attention kernel (vLLM's CPU attention here): eviction as a prefix.

A compaction (`eviction_compaction.py`) packs the slots a policy keeps, in order, into a request's leading
slots, and each generated token goes to the next free slot, so a generating request's occupied slots are a
prefix of its slot space: slots [0, reads) over its block list with the prompt's freed blocks skipped
(`EvictionSpec.block_index`). Keys are stored after RoPE, so one stock paged call over that remapped block
table with `seq_len` = reads is the attention over the kept tokens at their logical positions. Per step the
builder makes, on the device, the read table (a prompt row: its own blocks, causally), the read lengths and
the slots every token is written to (a prompt token: vLLM's; a generated token: its slot in the prefix), and
hands them to the platform's builder; per layer the impl runs the step's due prompt compactions, one stock
cache write, one stock attention call, then the due compactions after it. The compactions read and write
the slots in the platform's own page layout (`cpu_attn_pages`).

Policies that observe the attention each slot gets (H2O) need probabilities no stock kernel returns: they
keep rlkv's torch form (`eviction_backend.py`), as does `kernel: "torch"` (the tests' exact reference).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from rlkv.vllm_plugin.eviction import STOCK_EVICTION_BACKENDS
from rlkv.vllm_plugin.eviction_backend import EvictionImpl, EvictionMetadata, EvictionMetadataBuilder
from rlkv.vllm_plugin.eviction_compaction import (
    PageViews,
    compact_all,
    remember,
    remember_decode,
    slot_blocks,
)
from rlkv.vllm_plugin.persistent import PersistentReads


def cpu_attn_pages(kv_cache: torch.Tensor) -> PageViews:
    """vLLM's CPU attention pages [blocks, H_kv, block, 2 D] as `PageViews`: per (block, head) the keys, stored
    transposed ([D, block]: the kernel reads a key column per slot), then the values ([block, D])."""
    blocks, heads, size, width = kv_cache.shape
    d = width // 2
    flat = kv_cache.view(blocks, heads, 2, size * d)
    return PageViews(
        flat[:, :, 0].view(blocks, heads, d, size).transpose(2, 3), flat[:, :, 1].view(blocks, heads, size, d)
    )


class CpuEvictionBuilder(EvictionMetadataBuilder):
    """The eviction group's schedule (`EvictionMetadataBuilder`), then vLLM's CPU attention metadata over the
    step's read tables, lengths and write slots."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.stock = CPUAttentionMetadataBuilder(kv_cache_spec, layer_names, vllm_config, device)
        scheduler = vllm_config.scheduler_config
        # the read table, lengths and write slots of a step with generated tokens, at fixed addresses
        self.persistent = PersistentReads(
            int(scheduler.max_num_seqs), int(scheduler.max_num_batched_tokens), device
        )

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> EvictionMetadata:
        out = super().build(common_prefix_len, common_attn_metadata, fast_build)
        out.stock = self.stock.build(0, self.read_metadata(common_attn_metadata, out), fast_build)
        return out

    def read_metadata(self, m: Any, out: EvictionMetadata) -> Any:
        """The step's metadata with the read table, lengths and write slots the platform kernel reads (in
        persistent buffers where they differ from vLLM's own: a step with generated tokens)."""
        size, reqs = self.spec.block_size, m.num_reqs
        table, lengths, slots = m.block_table_tensor[:reqs], m.seq_lens[:reqs], m.slot_mapping
        if out.decode_tokens is not None:
            # a generating request reads its slots [0, reads): column c of its read table is its list's block
            # `block_index` (the kept prompt blocks, then those after the prompt's); a prompt row's is its own
            pairs = torch.zeros(reqs, 2, dtype=torch.long, device=table.device)
            pairs[out.decode_requests] = out.decode_blocks
            columns = torch.arange(table.shape[1], device=table.device)[None, :].expand(reqs, -1)
            requests = torch.arange(reqs, device=table.device)
            read_table, _ = slot_blocks(table, requests, pairs, columns * size, size)  # every read's rule
            table = self.persistent.table(read_table)
            lengths = self.persistent.lengths(lengths)
            lengths[out.decode_requests] = out.decode_reads.to(lengths.dtype)
            slots = self.persistent.slots(slots)
            block = table[out.decode_requests, out.decode_slots // size].to(torch.long)
            slots[out.decode_tokens] = (block * size + out.decode_slots % size).to(slots.dtype)
        return dataclasses.replace(
            m,
            seq_lens=lengths,
            block_table_tensor=table,
            slot_mapping=slots,
            _num_computed_tokens_cache=None,
            _token_to_req_indices_cache=None,
        )


class CpuEvictionImpl(EvictionImpl):
    """`EvictionImpl` whose writes and attention are vLLM's CPU attention kernel's, over its page layout."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        *args: Any,
        **kwargs: Any,
    ):
        super().__init__(num_heads, head_size, scale, num_kv_heads, *args, **kwargs)
        self.stock = CPUAttentionBackendImpl(
            num_heads, head_size, scale, self.num_kv_heads, None, None, self.kv_cache_dtype
        )

    def pages(self, kv_cache: torch.Tensor) -> PageViews:
        return cpu_attn_pages(kv_cache)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: EvictionMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Compact what is due before the step, write key, value [T, H_kv, D], attend query [T, H_q, D] into
        output with the stock kernel, compact what is due after it."""
        if (
            attn_metadata is None
        ):  # profiling run: the tables are made here, where vLLM measures what is not KV
            self._tables(layer, query.device, query.dtype)
            return output
        m = attn_metadata
        positions, queries = self._tables(layer, query.device, query.dtype)
        if queries is not None:
            for _, first, count, length, row in m.prefill:
                remember(queries, row, query[first : first + count], length)
        for row, prompt in m.identity:
            positions[row, :, :prompt] = torch.arange(prompt, device=query.device)
        compact_all(self, layer, kv_cache, m, positions, queries, m.before, identity=True)
        tokens = m.stock.slot_mapping.shape[0]
        self.stock.do_kv_cache_update(layer, key[:tokens], value[:tokens], kv_cache, m.stock.slot_mapping)
        if m.decode_tokens is not None:
            positions[m.decode_rows, :, m.decode_slots] = m.decode_positions
        self.stock.forward(layer, query, key, value, kv_cache, m.stock, output)
        if queries is not None and m.decode_tokens is not None:
            remember_decode(queries, m, query)
        compact_all(self, layer, kv_cache, m, positions, queries, m.after, identity=False)
        return output


class CpuEvictionBackend(CPUAttentionBackend):
    """The eviction group's backend over vLLM's CPU attention (registered as `STOCK_EVICTION_BACKENDS["CPU_ATTN"]`)."""

    forward_includes_kv_cache_update: bool = True  # the impl writes, at slots of its own

    @staticmethod
    def get_name() -> str:
        return STOCK_EVICTION_BACKENDS["CPU_ATTN"][0]

    @staticmethod
    def get_impl_cls() -> type[CpuEvictionImpl]:
        return CpuEvictionImpl

    @staticmethod
    def get_builder_cls() -> type[CpuEvictionBuilder]:
        return CpuEvictionBuilder
