"""The attention backend of rlkv's token-eviction KV cache group (`eviction.py`): slots, schedule, compactions.

Per step the metadata builder (on the host) sorts the group's requests into those computing their prompt
and those generating, and decides, from rlkv's host-known schedule (`RowSchedule`, the transformers
static cache's), where each generated token goes and which requests compact after the step. Per layer
the impl then, in torch over vLLM's pages (layout `[block, kv head, slot, (key | value)]`, as the
sink/window group's):

1. a prompt chunk writes its keys and values at slot = position and attends every earlier prompt slot;
2. a request's first generated step compacts its prompt first when the schedule says so (the
   transformers path compacts right after the prompt forward: the same state);
3. each generated token is written at its slot and attends the request's occupied slots;
4. a due compaction builds a `CompressedStore` view of the request's slots (keys, values, their
   positions, the last observation queries) and runs the policy's own `select` on it
   (`rlkv.cache.static.budget.policy_view` / `keep_in_run`): the kept slots, in order, move to the
   leading slots. The same code, on the same tensors, as rlkv's static cache (`eviction_compaction.py`).

Per request, what the pages cannot hold lives in two tables per layer, indexed by a row the builder
gives each request (keyed by the request's first block, which it holds for its whole life: this
group never shares blocks): each slot's logical position per head, and the last observation queries.
The step's due compactions of a layer run as one policy call over the requests that can share a view.

This torch form is the exact reference (`kernel: "torch"`) and serves policies that observe attention (H2O);
elsewhere steps 1 and 3 run on the platform's own kernel (`eviction_stock.py`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from vllm.utils.math_utils import cdiv
from vllm.v1.attention.backend import AttentionBackend, AttentionMetadataBuilder, CommonAttentionMetadata

from rlkv.vllm_plugin.eviction_compaction import (
    PageViews,
    compact_all,
    remember,
    remember_decode,
    slot_blocks,
)
from rlkv.vllm_plugin.fence import step_inputs
from rlkv.vllm_plugin.observed import SlotTables, decode_attention, prompt_probabilities
from rlkv.vllm_plugin.sink_window_backend import PagedTorchImpl


@dataclass
class _RequestState:
    row: int  # the request's row in the layers' position and query tables
    prompt: int | None = None  # where its prefill ended (set at its first generated step)
    schedule: Any = None  # its `RowSchedule`
    compactions: int = 0


@dataclass
class EvictionMetadata:
    """One step of the group: host lists of what each request does, device block tables and positions.

    prefill: (request index, first token, tokens, sequence length, table row) per prompt chunk;
    decode_*: [W] per generated token: its token index, request index, table row, slot, occupied slots
    after writing it, and (kept prompt blocks, prompt blocks) of its request (`EvictionSpec.block_index`);
    before / after: compactions (request index, table row, occupied slots, kept slots, tokens, prompt,
    kept prompt blocks, prompt blocks) run before the step's writes (a prompt's) or after its attention;
    identity: (table row, prompt) of requests whose prompt stays whole at their first generated step (its
    slots' positions are recorded).
    """

    num_actual_tokens: int
    block_table: torch.Tensor
    positions: torch.Tensor
    prefill: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    decode_tokens: torch.Tensor | None = None
    decode_requests: torch.Tensor | None = None
    decode_rows: torch.Tensor | None = None
    decode_slots: torch.Tensor | None = None
    decode_reads: torch.Tensor | None = None
    decode_blocks: torch.Tensor | None = None  # [W, 2]: kept prompt blocks, prompt blocks
    max_read: int = 0
    before: list[tuple[int, ...]] = field(default_factory=list)
    after: list[tuple[int, ...]] = field(default_factory=list)
    identity: list[tuple[int, int]] = field(default_factory=list)
    stock: Any = None  # the platform backend's metadata of the step, where the group runs on its kernel
    decode_positions: torch.Tensor | None = None  # [W, 1]: the generated tokens' positions
    decode_query_slots: torch.Tensor | None = None  # [W]: their slots in the observation query rings


def _first_blocks(m: CommonAttentionMetadata) -> list[int]:
    """Each request's first block id in this group, on the host (a device-to-host copy on a GPU)."""
    return m.block_table_tensor[: m.num_reqs, 0].tolist()


class EvictionMetadataBuilder(AttentionMetadataBuilder[EvictionMetadata]):
    """Runs the group's schedule on the host: per request its prompt end, its slots and its compactions."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.spec = kv_cache_spec
        self.rows = 2 * int(vllm_config.scheduler_config.max_num_seqs)
        self.requests: OrderedDict[int, _RequestState] = OrderedDict()  # first block -> state, oldest first
        self.compactions = 0  # every compaction this group ran (all requests)
        self.observe = int(kv_cache_spec.settings().policy.observe_queries)  # the layers' query rings' size

    def _state(self, key: int, reset: bool) -> _RequestState:
        """The request's state (a new one, reusing the least recently seen row, when its key is new)."""
        state = self.requests.pop(key, None)
        if state is None:
            used = {s.row for s in self.requests.values()}
            free = [row for row in range(self.rows) if row not in used]
            if free:
                row = free[0]
            else:
                row = self.requests.pop(next(iter(self.requests))).row
            state = _RequestState(row)
        elif reset:
            state = _RequestState(state.row)
        self.requests[key] = state
        return state

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> EvictionMetadata:
        from rlkv.cache.static.budget import RowSchedule

        m, spec = common_attn_metadata, self.spec
        starts = m.query_start_loc_cpu.tolist()
        prefilling, seq_lens, positions = step_inputs(m)
        prefilling, seq_lens = prefilling.tolist(), seq_lens.tolist()
        keys = _first_blocks(m)
        out = EvictionMetadata(m.num_actual_tokens, m.block_table_tensor, positions)
        decode: list[tuple[int, int, int, int, int, int, int]] = []
        for r in range(m.num_reqs):
            first, count, length = starts[r], starts[r + 1] - starts[r], int(seq_lens[r])
            if count == 0:
                continue
            if prefilling[r] or count > 1:
                state = self._state(keys[r], reset=True)
                out.prefill.append((r, first, count, length, state.row))
                continue
            state = self._state(keys[r], reset=False)
            if state.prompt is None:  # the request's first generated step: its prompt is computed
                state.prompt = length - 1
                state.schedule = RowSchedule(spec.form, [state.prompt])
                if state.schedule.due(0):
                    p = state.prompt
                    kept, blocks = state.schedule.held(0)[0], cdiv(p, spec.block_size)
                    out.before.append((r, state.row, p, kept, p, p, blocks, blocks))
                    state.compactions += 1
                else:
                    out.identity.append((state.row, state.prompt))
            prompt, schedule = state.prompt, state.schedule
            early = prompt if spec.protect_prompt else 0
            generated = length - prompt
            slot = early + schedule.held(generated - 1)[0]
            blocks = spec.kept_prompt_blocks(prompt), cdiv(prompt, spec.block_size)
            decode.append((first, r, state.row, slot, slot + 1, *blocks))
            if schedule.due(generated):
                kept = early + schedule.held(generated)[0]
                out.after.append((r, state.row, slot + 1, kept, length, prompt, *blocks))
                state.compactions += 1
        self.compactions += len(out.before) + len(out.after)
        if decode:
            device = m.block_table_tensor.device
            columns = torch.tensor(decode, dtype=torch.long).to(device, non_blocking=True)
            (
                out.decode_tokens,
                out.decode_requests,
                out.decode_rows,
                out.decode_slots,
                out.decode_reads,
            ) = columns[:, :5].unbind(1)
            out.decode_blocks = columns[:, 5:]
            out.max_read = max(d[4] for d in decode)
            out.decode_positions = positions[out.decode_tokens][:, None]  # each layer's position table
            if self.observe:
                out.decode_query_slots = out.decode_positions[:, 0] % self.observe
        return out


@dataclass
class _DecodePlan:
    """Where a step's generated tokens write ([W] block ids, offsets) and read ([W, S]) and their occupied-slot
    mask [W, 1, 1, S]: the same for every layer of the group."""

    write_blocks: torch.Tensor
    write_offsets: torch.Tensor
    read_blocks: torch.Tensor
    read_offsets: torch.Tensor
    occupied: torch.Tensor


def _decode_plan(m: EvictionMetadata, size: int) -> _DecodePlan:
    """The step's `_DecodePlan`, built by the group's first layer and kept on the metadata for the others
    (compactions move slot contents, never the block table, so it holds for the whole step)."""
    cached = getattr(m, "_rlkv_decode_plan", None)
    if cached is not None:
        return cached
    requests, pairs = m.decode_requests, m.decode_blocks
    written, write_offsets = slot_blocks(m.block_table, requests, pairs, m.decode_slots[:, None], size)
    slots = torch.arange(m.max_read, device=requests.device)[None, :].expand(requests.shape[0], -1)
    read_blocks, read_offsets = slot_blocks(m.block_table, requests, pairs, slots, size)
    occupied = (slots < m.decode_reads[:, None])[:, None, None, :]
    m._rlkv_decode_plan = _DecodePlan(
        written[:, 0],
        write_offsets[:, 0],
        read_blocks,
        read_offsets,
        occupied,
    )
    return m._rlkv_decode_plan


class EvictionImpl(PagedTorchImpl):
    """Attention of an `EvictionAttention` layer: writes, attention and compactions of its slots."""

    tables: tuple[torch.Tensor, torch.Tensor | None] | None = None  # made in the profiling run (`_tables`)
    slot_tables: SlotTables | None = None  # an attention-observing policy's per-slot buffers (`_tables`)

    def _tables(self, layer: Any, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """The layer's per-request tables: slot positions [R, H_kv, capacity] and the last observation
        queries [R, H_q, observe, D] (None when the policy observes none); made in vLLM's profiling run, so
        vLLM sizes its KV pool from the memory left after them (on a GPU)."""
        if self.tables is None:
            spec, rows = layer.rlkv_spec, layer.rlkv_rows
            form, length = spec.form, spec.max_len
            capacity = length if spec.protect_prompt else min(length, spec.budget_at(length) + form.slack)
            positions = torch.full((rows, self.num_kv_heads, capacity), -1, dtype=torch.long, device=device)
            observe = int(layer.rlkv_policy.observe_queries)
            queries = (
                torch.zeros(rows, self.num_heads, observe, self.head_size, dtype=dtype, device=device)
                if observe
                else None
            )
            self.tables = (positions, queries)
            if layer.rlkv_policy.observe_attention:
                self.slot_tables = SlotTables(rows, self.num_kv_heads, capacity, device)
        return self.tables

    def pages(self, kv_cache: torch.Tensor) -> PageViews:
        """Keys and values of this layout (`[block, kv head, slot, key | value]`) as `PageViews`."""
        return PageViews(kv_cache[..., : self.head_size], kv_cache[..., self.head_size :])

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
        """Write key, value [T, H_kv, D], attend query [T, H_q, D] into output, compact what is due."""
        if (
            attn_metadata is None
        ):  # profiling run: the tables are made here, where vLLM measures what is not KV
            self._tables(layer, query.device, query.dtype)
            return output
        m, d, size = attn_metadata, self.head_size, kv_cache.shape[2]
        positions, queries = self._tables(layer, query.device, query.dtype)
        for r, first, count, length, row in m.prefill:
            wanted = torch.arange(length, device=query.device)
            blocks, offsets = m.block_table[r, wanted // size], wanted % size
            new = torch.cat([key[first : first + count], value[first : first + count]], dim=-1)
            kv_cache[blocks[length - count :], :, offsets[length - count :]] = new.to(kv_cache.dtype)
            kv = kv_cache[blocks, :, offsets].transpose(0, 1)  # [H_kv, L, 2D]
            visible = wanted[None, :] <= wanted[length - count :, None]
            out = F.scaled_dot_product_attention(
                query[first : first + count].transpose(0, 1),
                kv[..., :d],
                kv[..., d:],
                attn_mask=visible,
                scale=self.scale,
                enable_gqa=True,
            )
            output[first : first + count] = out.transpose(0, 1).to(output.dtype)
            if queries is not None:
                remember(queries, row, query[first : first + count], length)
            if self.slot_tables is not None:
                self._observe_prompt(layer, query[first : first + count], kv[..., :d], wanted, count, row)
        for row, prompt in m.identity:
            positions[row, :, :prompt] = torch.arange(prompt, device=query.device)
        compact_all(self, layer, kv_cache, m, positions, queries, m.before, identity=True)
        if m.decode_tokens is not None:
            self._decode(layer, query, key, value, kv_cache, m, positions, output)
            if queries is not None:
                remember_decode(queries, m, query)
        compact_all(self, layer, kv_cache, m, positions, queries, m.after, identity=False)
        return output

    def _observe_prompt(self, layer, query, keys, wanted, count: int, row: int) -> None:
        """Hand an attention-observing policy a prompt chunk's causal probabilities over the request's slots
        (the chunk's new slots reset first; a protected prompt is not scored by its own attention, as on the
        transformers path)."""
        tables, length = self.slot_tables, wanted.shape[0]
        new = wanted[length - count :]
        if count == length:  # a new prompt (or a preempted request's replay): its row's wide buffers go
            tables.wide.pop(row, None)
        lo = length - count  # the chunk's new slots below the capacity, host-known (no sync)
        fits = torch.arange(lo, max(lo, min(length, tables.capacity)), device=new.device)
        tables.reset(torch.full_like(fits, row), fits)
        if layer.rlkv_spec.protect_prompt:
            return
        view = tables.view(torch.tensor([row], device=new.device), length, [row])
        layer.rlkv_policy.on_attention(view, prompt_probabilities(query, keys, new, self.scale))
        view.store()

    def _decode(self, layer, query, key, value, kv_cache, m, positions, output) -> None:
        """Write each generated token at its slot, then attend its request's occupied slots (one SDPA, or an
        explicit softmax whose probabilities an attention-observing policy adds up)."""
        d, tokens = self.head_size, m.decode_tokens
        plan = _decode_plan(m, kv_cache.shape[2])  # shared by the group's layers this step
        new = torch.cat([key[tokens], value[tokens]], dim=-1).to(kv_cache.dtype)
        kv_cache[plan.write_blocks, :, plan.write_offsets] = new
        positions[m.decode_rows, :, m.decode_slots] = m.decode_positions
        kv = kv_cache[plan.read_blocks, :, plan.read_offsets].permute(0, 2, 1, 3)  # [W, H_kv, S, 2D]
        if self.slot_tables is not None:
            self.slot_tables.reset(m.decode_rows, m.decode_slots)
            out, probs = decode_attention(
                query[tokens], kv[..., :d], kv[..., d:], plan.occupied[:, 0, 0, :], self.scale
            )
            view = self.slot_tables.view(m.decode_rows, m.max_read)
            layer.rlkv_policy.on_attention(view, probs)
            view.store()
            output[tokens] = out.to(output.dtype)
            return
        out = F.scaled_dot_product_attention(
            query[tokens][:, :, None, :],
            kv[..., :d],
            kv[..., d:],
            attn_mask=plan.occupied,
            scale=self.scale,
            enable_gqa=True,
        )
        output[tokens] = out[:, :, 0, :].to(output.dtype)


class EvictionBackend(AttentionBackend):
    """vLLM attention backend of rlkv's evicting heads (any device torch runs on)."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "RLKV_EVICTION"  # eviction.BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[EvictionImpl]:
        return EvictionImpl

    @staticmethod
    def get_builder_cls() -> type[EvictionMetadataBuilder]:
        return EvictionMetadataBuilder
