"""The decode-step attention of a `StaticHeadMixedLayer` (rlkv/cache/static_layer.py): SDPA with a KV
head's query group packed as rows of one head, and the explicit softmax a policy that observes
attention needs."""

from __future__ import annotations

import torch


def decode_sdpa(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """One query token [B, H_kv * G, 1, D] over keys/values [B, H_kv, S, D], bool mask [B, 1 or H_kv, 1, S]
    (None: every key), the G query heads of a KV head packed as G rows of one SDPA head (every key read
    once). Returns [B, 1, H_kv * G, D]."""
    batch, heads, _, dim = query.shape
    packed = query.reshape(batch, keys.shape[1], heads // keys.shape[1], dim)
    out = torch.nn.functional.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scale)
    return out.reshape(batch, 1, heads, dim)


def observed_attention(
    q_comp: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token [B, H_c * G, 1, D] over slots [B, H_c, S, D] (valid BoolTensor [B, H_c, S]) with an
    explicit fp32 softmax, as the dynamic cache computes it for a policy that observes attention.
    Returns (output [B, 1, H_c * G, D], probabilities [B, H_c, G, 1, S])."""
    batch, heads, _, dim = q_comp.shape
    kv_heads = keys.shape[1]
    q = q_comp.reshape(batch, kv_heads, heads // kv_heads, 1, dim).float()
    logits = torch.matmul(q, keys[:, :, None].float().transpose(-1, -2)) * scale
    logits = logits.masked_fill(~valid[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
    out = torch.matmul(probs, values[:, :, None].float()).to(values.dtype)
    return out.reshape(batch, heads, 1, dim).transpose(1, 2), probs
