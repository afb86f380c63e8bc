"""`HeadMixedAttention`: a decoder layer's vLLM `Attention`, its KV heads split into full and windowed modules.

The stock model builds one `Attention` over all of a layer's heads; the head-mixed model replaces it
with this module, which holds `Attention` modules over disjoint KV-head subsets: the layer's full heads
(stock, a full-attention KV cache spec) and its compressed heads (rlkv's `SinkWindowAttention`, a
sink + window spec of its own, `sink_window.py`; or, for the window-only form, stock `Attention` with
`per_layer_sliding_window`). vLLM's hybrid KV cache manager puts the kinds in different KV cache groups
over one block pool, and the compressed kind's manager returns a head's blocks outside its sink and
window to that pool during decode: the memory a full head or another request then uses.

Every module holds `unit` KV heads (`HeadSplit.unit`), so every group has one page size; the compressed
modules' specs are spread over buckets (`groups.py`) so that vLLM's groups pad no full-attention part. The
decoder's own forward is unchanged: it calls `self.attn(q, k, v)` with q [T, H_q * D] and k, v
[T, H_kv * D] after RoPE. The layer's weights were permuted at load (`head_order.py`) so that its full
KV heads come first and its compressed ones after: each part's heads are a contiguous slice of q/k/v
(a view) and its output a slice of this module's output, in the served order o_proj was permuted to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlkv.vllm_plugin.fence import (
    attention_class,
    current_vllm_config,
    forget_attention_layer,
    layer_index,
    tensor_parallel,
)
from rlkv.vllm_plugin.head_order import HeadOrder
from rlkv.vllm_plugin.split import HeadSplit, HeadSplitError


class HeadMixedAttention(nn.Module):
    """Stands where a layer's stock `Attention` stood; attends its full and compressed KV heads separately.

    original: the stock `Attention` (its registration is dropped; no KV cache is allocated for it).
    full_kv_heads: KV heads of this layer with full attention; the others get `sliding_window` tokens.
    unit: KV heads per part (equal-sized parts keep one page size across KV cache groups).
    parallel: (tensor-parallel rank, size): this rank holds 1 / size of the layer's full and compressed heads.
    buckets: the spec bucket of each compressed part, keyed (layer, part index) (`HeadSplit.compressed_buckets`).
    """

    def __init__(
        self,
        original: nn.Module,
        full_kv_heads: tuple[int, ...],
        split: HeadSplit,
        unit: int,
        parallel: tuple[int, int] = (0, 1),
        buckets: dict[tuple[int, int], int] | None = None,
    ):
        super().__init__()
        num_kv, num_heads = original.num_kv_heads, original.num_heads  # this rank's share under TP
        self.num_kv_heads, self.groups, self.head_size = num_kv, num_heads // num_kv, original.head_size
        if getattr(original, "sliding_window", None) is not None:
            raise HeadSplitError(
                f"{original.layer_name} already has a sliding window ({original.sliding_window}): rlkv's "
                "head split serves models whose layers all attend fully"
            )
        backend = original.attn_backend
        if split.is_sliding_window and not backend.supports_sliding_window():
            raise HeadSplitError(
                f"attention backend {backend.get_name()} does not support sliding windows, so it cannot serve "
                "rlkv's compressed heads; pick a backend that does (CPU_ATTN, FLASH_ATTN, TRITON_ATTN)"
            )
        forget_attention_layer(original.layer_name)
        cache_config = current_vllm_config().cache_config
        rank, shards = parallel
        num_full = len(full_kv_heads) // shards
        layer = layer_index(original.layer_name)
        # this rank's KV heads, in the served order (`HeadSplit.served_order`): its full ones, then compressed
        served = split.served_order(layer, num_kv * shards, shards)[rank * num_kv : (rank + 1) * num_kv]
        # (module name, its served KV-head positions): full heads at [0, num_full), compressed after
        self.parts: list[tuple[str, slice]] = []
        for kind, start, stop in (("full", 0, num_full), ("window", num_full, num_kv)):
            for i, first in enumerate(range(start, stop, unit)):
                name, heads = f"{kind}_{i}", slice(first, min(first + unit, stop))
                bucket = (buckets or {}).get((layer, i), 0) if kind == "window" else 0
                part = _part(original, kind, (layer, served[heads]), split, cache_config, name, bucket)
                self.add_module(name, part)
                self.parts.append((name, heads))

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H_q * D] of query [T, H_q * D] over key, value [T, H_kv * D], heads in the
        served order."""
        if len(self.parts) == 1:
            return getattr(self, self.parts[0][0])(query, key, value)
        # a part's heads are contiguous columns: views with the row stride of the whole (as vLLM's own q, k, v,
        # split from one qkv projection), so no copy goes in; the parts' outputs are joined by one cat
        q_width, kv_width = self.groups * self.head_size, self.head_size
        outputs = [
            getattr(self, name)(
                query[:, heads.start * q_width : heads.stop * q_width],
                key[:, heads.start * kv_width : heads.stop * kv_width],
                value[:, heads.start * kv_width : heads.stop * kv_width],
            )
            for name, heads in self.parts
        ]
        return torch.cat(outputs, dim=1)


def _part(
    original: nn.Module,
    kind: str,
    heads: tuple[int, tuple[int, ...]],
    split: HeadSplit,
    cache_config: Any,
    name: str,
    bucket: int = 0,
) -> nn.Module:
    """One attention module over the KV heads `heads` (the layer, its stock KV heads): stock full attention,
    vLLM's sliding window, rlkv's sink/window form or rlkv's token eviction (the last two in spec `bucket`)."""
    layer, head_ids = heads
    num_kv = len(head_ids)
    args = (num_kv * (original.num_heads // original.num_kv_heads), original.head_size, original.impl.scale)
    kwargs = dict(
        num_kv_heads=num_kv,
        cache_config=cache_config,
        quant_config=original.quant_config,
        prefix=f"{original.layer_name}.{name}",
        attn_type=original.attn_type,
    )
    if kind == "full":
        return attention_class()(*args, **kwargs)
    if split.policy is not None:
        from rlkv.vllm_plugin.eviction import EvictionAttention

        return EvictionAttention(
            *args,
            **split.policy.layer_kwargs(split),
            layer_index=layer,
            head_ids=head_ids,
            bucket=bucket,
            platform=original.attn_backend if split.kernel == "stock" else None,
            **kwargs,
        )
    if split.is_sliding_window:
        return attention_class()(*args, per_layer_sliding_window=split.vllm_sliding_window, **kwargs)
    from rlkv.vllm_plugin.ring import RingAttention, ring_backend
    from rlkv.vllm_plugin.sink_window import SinkWindowAttention

    ring = ring_backend(original.attn_backend) if split.uses_ring else None
    return (RingAttention if ring is not None else SinkWindowAttention)(
        *args,
        backend=ring,
        sink=split.sink,
        window=split.window,
        full_prompt=split.full_prompt,
        protect_prompt=split.protect_prompt,
        bucket=bucket,
        **kwargs,
    )


def split_attention_layers(model: nn.Module, split: HeadSplit, num_kv_heads: int) -> HeadOrder:
    """Replace every stock decoder `Attention` of `model` by a `HeadMixedAttention`; returns the head order
    its weights must be loaded in (`HeadOrder.weights`).

    A layer whose heads are all full keeps its stock module (one full-attention part, the same spec). Under
    tensor parallelism (`split.check_shards` passed at engine start) each rank builds its share of every
    layer: the same parts and KV cache groups on every rank.
    """
    attention = attention_class()
    parallel = tensor_parallel()
    shards = parallel[1]
    unit = split.unit(num_kv_heads, shards)
    buckets = split.compressed_buckets(num_kv_heads, shards)
    orders: dict[int, tuple[int, ...]] = {}
    geometry = (1, 1)
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not attention:
                continue
            layer = layer_index(child.layer_name)
            full = split.full_kv_heads[layer]
            if len(full) == num_kv_heads and unit == num_kv_heads // shards:
                continue
            setattr(parent, child_name, HeadMixedAttention(child, full, split, unit, parallel, buckets))
            # the checkpoint's whole tensors are permuted; vLLM's loaders then give each rank its slice
            orders[layer] = split.served_order(layer, num_kv_heads, shards)
            geometry = (child.num_heads // child.num_kv_heads, child.head_size)
    return HeadOrder(orders, *geometry)
