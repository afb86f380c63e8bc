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
    Returns [B, Q, H, D]. Cost O(Q * (sink + C + local)) per head with query blocks of C <= local.
    """
    bsz, n_heads, q_len, dim = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_heads // n_kv
    device = query.device
    if valid is None:
        valid = torch.ones(bsz, kv_len, dtype=torch.bool, device=device)
    q = query.view(bsz, n_kv, groups, q_len, dim)
    q_start = kv_len - q_len
    neg = torch.finfo(query.dtype).min

    # Sink keys: the first `sink` valid keys of each row (left padding shifts them right).
    pad = (~valid).long().cumprod(dim=1).sum(dim=1)  # leading pad count per row, [B]
    n_sink = min(sink, kv_len)
    sink_pos = (pad[:, None] + torch.arange(n_sink, device=device)).clamp_max(kv_len - 1)  # [B, S]
    gather = sink_pos[:, None, :, None].expand(bsz, n_kv, n_sink, dim)
    k_sink, v_sink = key.gather(2, gather), value.gather(2, gather)
    q_pos = q_start + torch.arange(q_len, device=device)  # [Q]
    sink_ok = (
        (sink_pos[:, None, :] <= q_pos[None, :, None])
        & (
            q_pos[None, :, None] - sink_pos[:, None, :] >= local
        )  # inside the window: counted by the local part
        & (pad[:, None, None] + torch.arange(n_sink, device=device) < kv_len)
        & valid.gather(1, sink_pos)[:, None, :]
    )  # [B, Q, S]
    s_sink = torch.einsum("bkgqd,bksd->bkgqs", q, k_sink) * scaling
    s_sink = s_sink.masked_fill(~sink_ok[:, None, None], neg)

    # Local band: query block b (C queries) sees a window of C + local - 1 keys ending at its last query.
    block = max(1, min(local, q_len))
    n_blocks = -(-q_len // block)
    q_pad = n_blocks * block - q_len
    width = block + local - 1
    # keys laid out so window b starts at padded index b * block; left pad local - 1, right pad q_pad
    lead = local - 1 - q_start
    k_src, v_src, valid_src = key, value, valid
    if lead < 0:  # skip keys no query can reach through the band
        k_src, v_src, valid_src = key[:, :, -lead:], value[:, :, -lead:], valid[:, -lead:]
        lead = 0
    k_band = torch.nn.functional.pad(k_src, (0, 0, lead, q_pad))
    v_band = torch.nn.functional.pad(v_src, (0, 0, lead, q_pad))
    valid_band = torch.nn.functional.pad(valid_src, (lead, q_pad), value=False)
    k_win = k_band.unfold(2, width, block).transpose(-1, -2)  # [B, H_kv, NB, W, D]
    v_win = v_band.unfold(2, width, block).transpose(-1, -2)
    valid_win = valid_band.unfold(1, width, block)  # [B, NB, W]
    q_blk = torch.nn.functional.pad(q, (0, 0, 0, q_pad)).view(bsz, n_kv, groups, n_blocks, block, dim)
    s_band = torch.einsum("bkgncd,bknwd->bkgncw", q_blk, k_win) * scaling
    # offset of key w relative to query c inside block: key index - query index = w - (local - 1) - c
    rel = (
        torch.arange(width, device=device)[None, :]
        - (local - 1)
        - torch.arange(block, device=device)[:, None]
    )
    band_ok = ((rel <= 0) & (rel > -local))[None, None] & valid_win[:, :, None, :]  # [B, NB, C, W]
    s_band = s_band.masked_fill(~band_ok[:, None, None], neg)
    s_band = s_band.reshape(bsz, n_kv, groups, n_blocks * block, width)[:, :, :, :q_len]

    probs = torch.softmax(torch.cat([s_sink, s_band], dim=-1), dim=-1)
    p_sink, p_band = probs.split([n_sink, width], dim=-1)
    p_band = torch.nn.functional.pad(p_band, (0, 0, 0, q_pad)).view(bsz, n_kv, groups, n_blocks, block, width)
    out = torch.einsum("bkgqs,bksd->bkgqd", p_sink, v_sink)
    out_band = torch.einsum("bkgncw,bknwd->bkgncd", p_band, v_win).reshape(bsz, n_kv, groups, -1, dim)
    out = out + out_band[:, :, :, :q_len]
    return out.reshape(bsz, n_heads, q_len, dim).transpose(1, 2)


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

    Reads the layer's gates from `module._rlkv_gates` (set by `attach_gates`). Returns ([B, Q, H, D], None).
    """
    gates = module._rlkv_gates
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
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
