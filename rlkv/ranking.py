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


def select_balanced_heads(
    scores: torch.Tensor, tie_break: torch.Tensor | None, count: int, shards: int, min_full_per_layer: int = 0
) -> torch.Tensor:
    """BoolTensor like `scores` [L, H_kv] whose every layer keeps a multiple of `shards` full heads (vLLM's
    tensor parallelism over `shards` ranks): each layer's heads, in the ranking's order, form groups of
    `shards`; the round(count / shards) groups of the best mean rank are kept (ties: the lower layer), after
    reserving ceil(min_full_per_layer / shards) groups of every layer. So the total is within shards / 2 of
    `count` (unless the reservation alone passes it) and every layer keeps its most important heads."""
    layers, heads = scores.shape
    order = rank_heads(scores, tie_break)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    by_layer = torch.sort(rank.view_as(scores), dim=1)  # per layer: ranks ascending, and which heads
    groups = heads // shards
    # a group's priority: the sum of its heads' ranks (increasing within a layer, so the kept groups are
    # always a layer's first ones)
    group_rank = by_layer.values.view(layers, groups, shards).sum(dim=-1)
    reserved = -(-min_full_per_layer // shards)
    chosen = torch.zeros(layers, groups, dtype=torch.bool)
    chosen[:, :reserved] = True
    wanted = max(round(count / shards) - int(chosen.sum()), 0)
    ranks = group_rank.tolist()
    candidates = sorted(
        (ranks[layer][g], layer, g) for layer in range(layers) for g in range(reserved, groups)
    )
    for _, layer, g in candidates[:wanted]:
        chosen[layer, g] = True
    mask = torch.zeros(layers, heads, dtype=torch.bool)
    kept = chosen.repeat_interleave(shards, dim=1)  # [L, H] in each layer's ranking order
    mask.scatter_(1, by_layer.indices, kept)
    return mask


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
