"""The attention backend of rlkv's sink + window KV cache group (`sink_window.py`): exact masks in torch.

The group's pages are vLLM's (its block pool, its block tables, its slot mapping); this backend stores
each token's key and value in its own page layout, `[block, kv head, slot, (key | value)]`, and reads
them back by block table, so it never depends on a kernel's packed layout. Per layer and step:

- a query of a request still computing its prompt (`full_prompt`) attends every earlier position of
  that request, causally (one SDPA per such request: prompts are few per step);
- every other query at position p attends positions [0, sink) and [p - window, p]: one batched SDPA
  over all of them, `sink + window + 1` gathered keys each, masked where a position does not exist yet;
- with a protected prompt, such a query also attends every prompt position of its request: the builder
  marks, per physical slot, whether a prompt token was written there (`prompt_slots`, one bool per slot
  of the pool, rewritten whenever a slot is written), and the query gathers positions [0, p] masked to
  the marked ones, its sink and its window (freed blocks read as vLLM's null block, never marked).

Keys are stored after RoPE, so gathering them in any order attends them at their logical positions.
Prefill and decode numbers match rlkv's transformers path within float tolerance (the vLLM tier).
On a GPU the same torch ops run without a host read of a device tensor in decode (padded tokens are not
filtered out but aimed at vLLM's null slot); CUDA graphs are not captured for this
group (`AttentionCGSupport.NEVER`), a known cost there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from rlkv.vllm_plugin.fence import step_inputs


@dataclass
class SinkWindowMetadata:
    """What one step's attention needs: host counts, device block tables and positions.

    prefill_requests: (request index, first query token, query tokens, sequence length) of each request
    read in full this step; window_tokens / window_requests: [W] token and request indices of every other
    query; positions: [T] logical positions; block_table: [R, max blocks].
    """

    num_actual_tokens: int
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    positions: torch.Tensor
    prefill_requests: list[tuple[int, int, int, int]]
    window_tokens: torch.Tensor
    window_requests: torch.Tensor
    prompt_slots: torch.Tensor | None = None  # [slots of the pool] bool: a prompt token is stored there
    max_window_length: int = 0  # the longest sequence among the windowed queries' requests (host)


class SinkWindowMetadataBuilder(AttentionMetadataBuilder[SinkWindowMetadata]):
    """Splits a step's queries into requests read in full (their prompt) and windowed ones, on the host."""

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.full_prompt = bool(getattr(kv_cache_spec, "full_prompt", True))
        self.protect_prompt = bool(getattr(kv_cache_spec, "protect_prompt", False))
        # one flag per slot of the pool, sized once from the pool (no host read of a device tensor per step)
        slots = (vllm_config.cache_config.num_gpu_blocks or 0) * kv_cache_spec.block_size
        self.prompt_slots = (
            torch.zeros(slots, dtype=torch.bool, device=device) if self.protect_prompt and slots else None
        )

    def _mark_prompt_slots(self, slot_mapping: torch.Tensor, is_prompt: torch.Tensor) -> torch.Tensor:
        """Record, for every slot written this step, whether it now holds a prompt token."""
        if self.prompt_slots is None:
            raise RuntimeError(
                "rlkv's protected-prompt group needs the KV pool's size when its metadata builder starts "
                "(cache_config.num_gpu_blocks); this vLLM sets it later: serve without --protect-prompt"
            )
        slots = slot_mapping[: is_prompt.numel()]
        valid = slots >= 0  # padded tokens carry -1: they mark vLLM's null slot 0 as not a prompt token
        self.prompt_slots[slots.clamp(min=0)] = is_prompt & valid
        return self.prompt_slots

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> SinkWindowMetadata:
        m = common_attn_metadata
        starts = m.query_start_loc_cpu.tolist()
        num_reqs = m.num_reqs
        prefilling, seq_lens, positions = step_inputs(m)
        flags = [bool(x) and self.full_prompt for x in prefilling.tolist()]
        seq_lens = seq_lens.tolist()
        prefill, window_tokens, window_requests = [], [], []
        for r in range(num_reqs):
            first, count = starts[r], starts[r + 1] - starts[r]
            if count == 0:
                continue
            if flags[r]:
                prefill.append((r, first, count, int(seq_lens[r])))
            else:
                window_tokens.extend(range(first, first + count))
                window_requests.extend([r] * count)
        device = m.block_table_tensor.device
        prompt_slots = None
        if self.protect_prompt:
            is_prompt = torch.zeros(starts[num_reqs], dtype=torch.bool)
            for r in range(num_reqs):
                is_prompt[starts[r] : starts[r + 1]] = flags[r]
            prompt_slots = self._mark_prompt_slots(m.slot_mapping, is_prompt.to(device, non_blocking=True))
        return SinkWindowMetadata(
            num_actual_tokens=m.num_actual_tokens,
            block_table=m.block_table_tensor,
            slot_mapping=m.slot_mapping,
            positions=positions,
            prefill_requests=prefill,
            window_tokens=torch.tensor(window_tokens, dtype=torch.long).to(device, non_blocking=True),
            window_requests=torch.tensor(window_requests, dtype=torch.long).to(device, non_blocking=True),
            prompt_slots=prompt_slots,
            max_window_length=max((int(seq_lens[r]) for r in set(window_requests)), default=0),
        )


class PagedTorchImpl(AttentionImpl):
    """What rlkv's torch attention impls over vLLM's pages share (this group's and the eviction group's):
    plain softmax attention over an unquantized cache, heads and scale as vLLM passes them."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        **extra: Any,
    ) -> None:
        if (
            alibi_slopes is not None
            or logits_soft_cap
            or sliding_window is not None
            or kv_cache_dtype != "auto"
        ):
            raise NotImplementedError(
                "rlkv's compressed heads attend plain softmax attention over an unquantized cache: no ALiBi, "
                "soft cap, sliding window or kv_cache_dtype other than auto"
            )
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.groups = self.num_heads // self.num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name


class SinkWindowImpl(PagedTorchImpl):
    """Attention of a `SinkWindowAttention` layer; the form (sink, window, full_prompt) is read from the layer."""

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write key, value [T, H_kv, D] into kv_cache [blocks, H_kv, block, 2 * D] at slot_mapping [T]."""
        tokens = min(key.shape[0], slot_mapping.shape[0])
        slots = slot_mapping[:tokens]
        # padded tokens carry -1: they aim at vLLM's null slot and write back what it holds, so no boolean
        # filter (a host sync on a GPU) is needed
        valid = (slots >= 0)[:, None, None]
        block_size = kv_cache.shape[2]
        blocks, offsets = slots.clamp(min=0) // block_size, slots.clamp(min=0) % block_size
        new = torch.cat([key[:tokens], value[:tokens]], dim=-1).to(kv_cache.dtype)
        kv_cache[blocks, :, offsets] = torch.where(valid, new, kv_cache[blocks, :, offsets])

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: SinkWindowMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of query [T, H_q, D] over the cached keys (written before this call) into output."""
        if attn_metadata is None:  # profiling run
            return output
        m, d = attn_metadata, self.head_size
        plan = _plan(m, layer, kv_cache.shape[2], query.device)  # shared by the group's layers this step
        for (first, count), (blocks, offsets, visible) in zip(
            ((f, c) for _, f, c, _ in m.prefill_requests), plan.prefill, strict=True
        ):
            kv = kv_cache[blocks, :, offsets].transpose(0, 1)  # [H_kv, L, 2D]: one gather for K and V
            q = query[first : first + count].transpose(0, 1)  # [H_q, Q, D]
            out = F.scaled_dot_product_attention(
                q, kv[..., :d], kv[..., d:], attn_mask=visible, scale=self.scale, enable_gqa=True
            )
            output[first : first + count] = out.transpose(0, 1).to(output.dtype)
        if plan.window is not None:
            blocks, offsets, exists = plan.window
            kv = kv_cache[blocks, :, offsets].permute(0, 2, 1, 3)  # [W, H_kv, S, 2D]
            q = query[m.window_tokens][:, :, None, :]  # [W, H_q, 1, D]
            out = F.scaled_dot_product_attention(
                q,
                kv[..., :d],
                kv[..., d:],
                attn_mask=exists[:, None, None, :],
                scale=self.scale,
                enable_gqa=True,
            )
            output[m.window_tokens] = out[:, :, 0, :].to(output.dtype)
        return output


@dataclass
class _GatherPlan:
    """Where a step's queries read: per prompt request (blocks, offsets, causal mask [Q, L]) and for the
    windowed queries (blocks, offsets, mask [W, S]); the same for every layer of the group."""

    prefill: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None


def _plan(m: SinkWindowMetadata, layer: Any, block: int, device: torch.device) -> _GatherPlan:
    """The step's `_GatherPlan`, built by the group's first layer and kept on the metadata for the others."""
    cached = getattr(m, "_rlkv_plan", None)
    if cached is not None:
        return cached
    prefill = []
    for r, _, count, length in m.prefill_requests:
        positions = torch.arange(length, device=device)
        visible = (
            positions[None, :] <= positions[length - count :, None]
        )  # causal over every earlier position
        prefill.append((m.block_table[r, positions // block], positions % block, visible))
    window = (
        _window_plan(m, layer.rlkv_sink, layer.rlkv_window, block, device)
        if m.window_tokens.numel()
        else None
    )
    m._rlkv_plan = _GatherPlan(prefill, window)
    return m._rlkv_plan


def _window_plan(
    m: SinkWindowMetadata, sink: int, window: int, block: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(blocks, offsets, exists) [W, S] of the windowed queries: their sink and their window (S = sink +
    window + 1), or with a protected prompt every position up to their own, masked to prompt, sink, window."""
    p = m.positions[m.window_tokens][:, None]  # [W, 1]
    if m.prompt_slots is not None:
        wanted = torch.arange(m.max_window_length, device=device)[None, :].expand(p.shape[0], -1)
        blocks = m.block_table[m.window_requests[:, None], wanted // block]
        slots = (blocks * block + wanted % block).clamp(max=m.prompt_slots.numel() - 1)
        recent = (wanted >= p - window) | (wanted < sink)
        return blocks, wanted % block, (wanted <= p) & (recent | m.prompt_slots[slots])
    j = torch.arange(sink + window + 1, device=device)[None, :]
    wanted = torch.where(j < sink, j, p - window + (j - sink))  # [W, S]: sink positions, then the window
    # a sink position inside the window is read there; positions before 0 do not exist yet
    exists = (wanted >= 0) & ((j >= sink) | (wanted < p - window))
    wanted = wanted.clamp(min=0)
    return m.block_table[m.window_requests[:, None], wanted // block], wanted % block, exists


class SinkWindowBackend(AttentionBackend):
    """vLLM attention backend of rlkv's sink/window heads (any device torch runs on)."""

    forward_includes_kv_cache_update: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        return "RLKV_SINK_WINDOW"  # sink_window.BACKEND_NAME, registered with vLLM under it

    @staticmethod
    def get_impl_cls() -> type[SinkWindowImpl]:
        return SinkWindowImpl

    @staticmethod
    def get_builder_cls() -> type[SinkWindowMetadataBuilder]:
        return SinkWindowMetadataBuilder
