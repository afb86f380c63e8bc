"""`HeadMixedAttention`: a decoder layer's vLLM `Attention`, its KV heads split into full and windowed modules.

The stock model builds one `Attention` over all of a layer's heads; the head-mixed model replaces it
with this module, which holds `Attention` modules over disjoint KV-head subsets: the layer's full heads
(stock, a full-attention KV cache spec) and its compressed heads (rlkv's `SinkWindowAttention`, a
sink + window spec of its own, `sink_window.py`; or, for the window-only form, stock `Attention` with
`per_layer_sliding_window`). vLLM's hybrid KV cache manager puts the kinds in different KV cache groups
over one block pool, and the compressed kind's manager returns a head's blocks outside its sink and
window to that pool during decode: the memory a full head or another request then uses.

Every module holds `unit` KV heads (`HeadSplit.unit`), so every group has one page size. The
decoder's own forward is unchanged: it calls `self.attn(q, k, v)` with q [T, H_q * D] and k, v
[T, H_kv * D] after RoPE; this module picks each part's heads (a view when they are contiguous),
runs the part and writes its output columns back in head order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlkv.vllm_plugin.fence import attention_class, current_vllm_config, forget_attention_layer, layer_index
from rlkv.vllm_plugin.split import HeadSplit, HeadSplitError


class HeadMixedAttention(nn.Module):
    """Stands where a layer's stock `Attention` stood; attends its full and compressed KV heads separately.

    original: the stock `Attention` (its registration is dropped; no KV cache is allocated for it).
    full_kv_heads: KV heads of this layer with full attention; the others get `sliding_window` tokens.
    unit: KV heads per part (equal-sized parts keep one page size across KV cache groups).
    """

    def __init__(self, original: nn.Module, full_kv_heads: tuple[int, ...], split: HeadSplit, unit: int):
        super().__init__()
        num_kv, num_heads = original.num_kv_heads, original.num_heads
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
        full = tuple(full_kv_heads)
        compressed = tuple(h for h in range(num_kv) if h not in set(full))
        self.parts: list[tuple[str, tuple[int, ...]]] = []
        for kind, heads in (("full", full), ("window", compressed)):
            for i in range(0, len(heads), unit):
                name, part_heads = f"{kind}_{i // unit}", heads[i : i + unit]
                self.add_module(name, _part(original, kind, len(part_heads), split, cache_config, name))
                self.parts.append((name, part_heads))
        # each part's heads as a slice (a view of q/k/v) when contiguous, else an index tensor
        self._picks = [_pick(heads) for _, heads in self.parts]

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Attention output [T, H_q * D] of query [T, H_q * D] over key, value [T, H_kv * D]."""
        tokens = query.shape[0]
        q = query.view(tokens, self.num_kv_heads, self.groups * self.head_size)
        k = key.view(tokens, self.num_kv_heads, self.head_size)
        v = value.view(tokens, self.num_kv_heads, self.head_size)
        if len(self.parts) == 1:
            return getattr(self, self.parts[0][0])(query, key, value)
        out = torch.empty_like(q)
        for i, (name, heads) in enumerate(self.parts):
            n, pick = len(heads), self._picks[i]
            if isinstance(pick, slice):
                qs, ks, vs = q[:, pick], k[:, pick], v[:, pick]
            else:
                if pick.device != query.device:  # moved once, on the first forward (no copy per step)
                    pick = self._picks[i] = pick.to(query.device)
                qs, ks, vs = q.index_select(1, pick), k.index_select(1, pick), v.index_select(1, pick)
            part_out = getattr(self, name)(
                qs.reshape(tokens, -1), ks.reshape(tokens, -1), vs.reshape(tokens, -1)
            )
            part_out = part_out.view(tokens, n, self.groups * self.head_size)
            if isinstance(pick, slice):
                out[:, pick] = part_out
            else:
                out.index_copy_(1, pick, part_out)
        return out.view(tokens, -1)


def _part(
    original: nn.Module, kind: str, num_kv: int, split: HeadSplit, cache_config: Any, name: str
) -> nn.Module:
    """One attention module over `num_kv` KV heads: stock full attention, vLLM's sliding window, or rlkv's
    sink/window form."""
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
    if split.is_sliding_window:
        return attention_class()(*args, per_layer_sliding_window=split.vllm_sliding_window, **kwargs)
    from rlkv.vllm_plugin.sink_window import SinkWindowAttention

    return SinkWindowAttention(
        *args,
        sink=split.sink,
        window=split.window,
        full_prompt=split.full_prompt,
        protect_prompt=split.protect_prompt,
        **kwargs,
    )


def _pick(heads: tuple[int, ...]) -> slice | torch.Tensor:
    if heads[-1] - heads[0] + 1 == len(heads):
        return slice(heads[0], heads[-1] + 1)
    return torch.tensor(heads, dtype=torch.long)


def split_attention_layers(model: nn.Module, split: HeadSplit, num_kv_heads: int) -> int:
    """Replace every stock decoder `Attention` of `model` by a `HeadMixedAttention`; returns how many.

    A layer whose heads are all full keeps its stock module (one full-attention part, the same spec).
    """
    attention = attention_class()
    unit = split.unit(num_kv_heads)
    replaced = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if type(child) is not attention:
                continue
            layer = layer_index(child.layer_name)
            full = split.full_kv_heads[layer]
            if len(full) == num_kv_heads and unit == num_kv_heads:
                continue
            setattr(parent, child_name, HeadMixedAttention(child, full, split, unit))
            replaced += 1
    return replaced
