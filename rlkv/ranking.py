"""How a head mask's scores become an order of heads and a set of full heads at a sparsity.

Heads are ranked by score (higher = more important), equal scores by the tie-break (higher first),
and where both tie the lower (layer, head) index first, so every result is deterministic.
"""

from __future__ import annotations

import torch


def rank_heads(scores: torch.Tensor, tie_break: torch.Tensor | None = None) -> torch.Tensor:
    """Flat (layer * H_kv + head) indices of `scores` [L, H_kv], most important first.

    By score (higher first), equal scores by `tie_break` (same shape, higher first), and where both
    tie the lower index first. Works on any device; no host read.
    """
    # stable sorts from the last key to the first; the index is the last key
    idx = torch.arange(scores.numel(), device=scores.device)
    if tie_break is not None:
        idx = idx[torch.sort(-tie_break.flatten()[idx], stable=True).indices]
    return idx[torch.sort(-scores.flatten()[idx], stable=True).indices]


def compression_order(scores: torch.Tensor, tie_break: torch.Tensor | None) -> torch.Tensor:
    """LongTensor[L * H_kv, 2]: (layer, head) pairs from least to most important (compression order)."""
    heads = scores.shape[1]
    idx = rank_heads(scores, tie_break).flip(0)
    return torch.stack([idx // heads, idx % heads], dim=1)


def select_full_heads(
    scores: torch.Tensor, tie_break: torch.Tensor | None, count: int, min_full_per_layer: int = 0
) -> torch.Tensor:
    """BoolTensor like `scores` [L, H_kv]: the `count` most important heads, after reserving the
    `min_full_per_layer` most important of every layer (the total exceeds `count` only when that
    reservation alone does)."""
    layers, heads = scores.shape
    order = rank_heads(scores, tie_break)  # most important first
    mask = torch.zeros(scores.numel(), dtype=torch.bool)
    if min_full_per_layer:
        rank = torch.empty_like(order)
        rank[order] = torch.arange(order.numel())
        per_layer = torch.sort(rank.view_as(scores), dim=1).indices[:, :min_full_per_layer]
        rows = torch.arange(layers).unsqueeze(1) * heads
        mask[(rows + per_layer).flatten()] = True
    remaining = count - int(mask.sum())
    for idx in order.tolist():
        if remaining <= 0:
            break
        if not mask[idx]:
            mask[idx] = True
            remaining -= 1
    return mask.view_as(scores)


def ties_decided_by_index(scores: torch.Tensor, tie_break: torch.Tensor | None) -> int:
    """How many neighbouring pairs of the ranking are decided by index alone (equal score and tie-break)."""
    flat = rank_heads(scores, tie_break)
    keys = [scores.flatten()[flat]]
    if tie_break is not None:
        keys.append(tie_break.flatten()[flat])
    same = torch.ones(flat.numel() - 1, dtype=torch.bool)
    for key in keys:
        same &= key[1:] == key[:-1]
    return int(same.sum())
