"""A layer's full and compressed heads as indices, and a slice when they are contiguous (`head_indices`).

A contiguous run of heads (a layer with one full KV head, or full heads 0..k) is served by a view
(`narrow`) instead of `index_select`, and the two halves of an output are joined by one `cat` instead
of an allocation and two indexed writes: fewer ops per decode step and no copy on the read side.
Both caches use these; the values are bitwise those of the gather path.
"""

from __future__ import annotations

import torch


def head_indices(mask: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, slice | None]:
    """(indices, slice-or-None) of the True entries of `mask` [H], each widened to `groups` consecutive
    heads (GQA: KV head h serves query heads h*G .. h*G+G-1); the slice is None unless they are contiguous."""
    kv = torch.nonzero(mask, as_tuple=True)[0]
    idx = (kv[:, None] * groups + torch.arange(groups, device=kv.device)).flatten()
    if kv.numel() and int(kv[-1] - kv[0]) + 1 == kv.numel():
        return idx, slice(int(kv[0]) * groups, (int(kv[-1]) + 1) * groups)
    return idx, None


def pick_heads(t: torch.Tensor, idx: torch.Tensor, sl: slice | None, dim: int = 1) -> torch.Tensor:
    """Heads `idx` of `t` along `dim`: a view when they are the slice `sl`, else a gather (a copy)."""
    if sl is not None:
        if sl.stop - sl.start == t.shape[dim]:
            return t  # every head
        return t.narrow(dim, sl.start, sl.stop - sl.start)
    return t.index_select(dim, idx)


def merge_heads(
    first: torch.Tensor,
    second: torch.Tensor,
    first_idx: torch.Tensor,
    first_slice: slice | None,
    second_idx: torch.Tensor,
    second_slice: slice | None,
    dim: int = 2,
) -> torch.Tensor:
    """One tensor holding `first` at heads `first_idx` and `second` at `second_idx` along `dim` (together
    every head once): a single `cat` when the two are contiguous runs, else an allocation and two writes."""
    if first_slice is not None and second_slice is not None:
        if first_slice.stop == second_slice.start:
            return torch.cat([first, second], dim=dim)
        if second_slice.stop == first_slice.start:
            return torch.cat([second, first], dim=dim)
    shape = list(first.shape)
    shape[dim] = first_idx.numel() + second_idx.numel()
    out = first.new_empty(shape)
    out.index_copy_(dim, first_idx, first)
    out.index_copy_(dim, second_idx, second)
    return out
