"""RLKV's gated mixed attention, as a transformers attention function.

Per KV head h of layer l: `out = alpha[l, h] * full_attn + (1 - alpha[l, h]) * sink_local_attn`,
where sink+local attention lets a query see the first `sink` (non-padding) tokens of its row and
the last `local` tokens up to and including itself. Query heads of a GQA group share their KV
head's gate. The full branch is transformers' own SDPA attention, so alpha = 1 reproduces the
stock model; the sink+local branch costs O(T * (sink + 2 * local)) per head, never a dense T x T.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION_NAME = "rlkv_mixed"


def key_validity(attention_mask: torch.Tensor | None, batch: int, kv_len: int, device) -> torch.Tensor:
    """BoolTensor[B, K]: which key columns are real tokens, read from a 4D boolean (or additive) mask.

    The last query row of a causal mask sees every earlier key that is not padding, so it carries
    the key-padding pattern (transformers' padding mask acts on key columns only).
    """
    if attention_mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, :kv_len]
    valid = last if last.dtype == torch.bool else last == 0
    return valid.expand(batch, kv_len)


def sink_local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sink: int,
    local: int,
    scaling: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal sink+local attention for the last Q of K positions.

    query [B, H, Q, D], key/value [B, H_kv, K, D] (GQA not repeated), valid BoolTensor[B, K] marks
    real keys (left padding = False). A query at position i (queries are positions K-Q..K-1) sees
    key j iff j <= i, valid[j], and (j is among the first `sink` valid keys of its row, or i - j < local).
    Returns [B, Q, H, D]. Queries are cut into blocks of C <= local; each block attends, in one
    batched SDPA call, to the row's sink keys plus a window of C + local - 1 keys, so the cost is
    O(Q * (sink + C + local)) per head and no score matrix is kept for the backward pass.
    """
    bsz, n_heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    device = query.device
    if valid is None:
        valid = torch.ones(bsz, kv_len, dtype=torch.bool, device=device)
    q_start = kv_len - q_len
    block = max(1, min(local, q_len))
    n_blocks = -(-q_len // block)
    q_pad = n_blocks * block - q_len
    width = block + local - 1

    # Sink keys: the first `sink` valid keys of each row (left padding shifts them right).
    lead_pad = (~valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    n_sink = min(sink, kv_len)
    sink_idx = lead_pad[:, None] + torch.arange(n_sink, device=device)  # [B, S]
    sink_exists = sink_idx < kv_len
    sink_idx = sink_idx.clamp_max(kv_len - 1)
    gather = sink_idx[:, None, :, None].expand(bsz, key.shape[1], n_sink, dim)
    k_sink, v_sink = key.gather(2, gather), value.gather(2, gather)

    # Window b covers keys [q_start + b*C - local + 1, q_start + (b+1)*C); pad so indices start at 0.
    lead = local - 1 - q_start
    k_src, v_src, valid_src = key, value, valid
    if lead < 0:  # keys no query can reach through the band
        k_src, v_src, valid_src = key[:, :, -lead:], value[:, :, -lead:], valid[:, -lead:]
        lead = 0
    pad = torch.nn.functional.pad
    k_win = (
        pad(k_src, (0, 0, lead, q_pad)).unfold(2, width, block).permute(0, 2, 1, 4, 3)
    )  # [B, NB, H_kv, W, D]
    v_win = pad(v_src, (0, 0, lead, q_pad)).unfold(2, width, block).permute(0, 2, 1, 4, 3)
    valid_win = pad(valid_src, (lead, q_pad), value=False).unfold(1, width, block)  # [B, NB, W]

    expand = (bsz, n_blocks) + k_sink.shape[1:]
    k_all = torch.cat([k_sink[:, None].expand(expand), k_win], dim=3).flatten(0, 1)  # [B*NB, H_kv, S+W, D]
    v_all = torch.cat([v_sink[:, None].expand(expand), v_win], dim=3).flatten(0, 1)

    q_pos = (q_start + torch.arange(n_blocks * block, device=device)).view(n_blocks, block)  # [NB, C]
    sink_ok = (
        (sink_idx[:, None, None, :] <= q_pos[None, :, :, None])
        & (q_pos[None, :, :, None] - sink_idx[:, None, None, :] >= local)  # else the window holds it
        & (sink_exists & valid.gather(1, sink_idx))[:, None, None, :]
    )  # [B, NB, C, S]
    rel = (
        torch.arange(width, device=device)[None, :]
        - (local - 1)
        - torch.arange(block, device=device)[:, None]
    )
    band_ok = ((rel <= 0) & (rel > -local))[None, None] & valid_win[:, :, None, :]  # [B, NB, C, W]
    allowed = torch.cat([sink_ok, band_ok], dim=-1).flatten(0, 1)[:, None]  # [B*NB, 1, C, S+W]
    # additive mask: fully masked (padding) query rows get a uniform, finite softmax instead of NaN
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(query.dtype).min
    )
    q_blk = pad(query, (0, 0, 0, q_pad)).view(bsz, n_heads, n_blocks, block, dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_blk.flatten(0, 1), k_all, v_all, attn_mask=bias, scale=scaling, enable_gqa=True
    )  # [B*NB, H, C, D]
    out = out.view(bsz, n_blocks, n_heads, block, dim).permute(0, 1, 3, 2, 4).reshape(bsz, -1, n_heads, dim)
    return out[:, :q_len]


def mixed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: alpha-weighted mix of full SDPA and sink+local attention.

    Reads the layer's gates from `module._rlkv_gates` (set by `attach_gates`); a module without gates
    (e.g. another model sharing the same config object) runs stock SDPA. Returns ([B, Q, H, D], None).
    """
    gates = getattr(module, "_rlkv_gates", None)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if gates is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    alpha = gates.alpha[module.layer_idx].clamp(0.0, 1.0)  # [H_kv]
    needs_grad = torch.is_grad_enabled() and alpha.requires_grad
    all_full = not needs_grad and bool((alpha == 1).all())
    all_local = not needs_grad and bool((alpha == 0).all())
    if not all_local:
        full, _ = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, **kwargs
        )
        if all_full:
            return full, None
    valid = key_validity(attention_mask, query.shape[0], key.shape[2], query.device)
    local = sink_local_attention(query, key, value, gates.sink, gates.local, scaling, valid)
    if all_local:
        return local, None
    groups = query.shape[1] // key.shape[1]
    a = alpha.to(full.dtype).repeat_interleave(groups)[None, None, :, None]  # per query head
    return a * full + (1 - a) * local, None


def register() -> str:
    """Register the mixed attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, mixed_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
