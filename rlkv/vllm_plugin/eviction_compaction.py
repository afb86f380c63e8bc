"""The eviction group's compactions and observation queries, on either page layout (`eviction_backend.py`).

A compaction reads a request's occupied slots (keys, values and their logical positions), runs the policy's
own `select` on them (`rlkv.cache.static.budget.policy_view` / `keep_in_run`, the transformers static cache's
code) and moves the kept slots, in order, to the leading slots. It reads and writes the pages through
`PageViews`, so the same code serves rlkv's torch layout and the platform kernel's (`eviction_stock.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rlkv.vllm_plugin.observed import SlotView


@dataclass
class PageViews:
    """A layer's KV pages as two views [blocks, H_kv, block size, D] (keys, values) of one cache tensor:
    indexing `keys[blocks, :, offsets]` reads (or, assigned, writes) slots in whatever layout the cache has."""

    keys: torch.Tensor
    values: torch.Tensor


def slot_blocks(
    block_table: torch.Tensor, requests: torch.Tensor, blocks: torch.Tensor, slots: torch.Tensor, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(block ids, offsets) of `slots` [W, S] of requests [W] whose (kept prompt blocks, prompt blocks) are
    `blocks` [W, 2] (`EvictionSpec.block_index`)."""
    index = slots // size
    kept, prompt = blocks[:, :1], blocks[:, 1:]
    index = torch.where(index < kept, index, prompt + index - kept).clamp(max=block_table.shape[1] - 1)
    return block_table[requests[:, None], index], slots % size


def remember(queries: torch.Tensor, row: int, new: torch.Tensor, end: int) -> None:
    """Write a prompt chunk's queries new [Q, H_q, D] (positions [end - Q, end)) into row `row` of queries
    [R, H_q, observe, D]: position p at slot p % observe (a ring: one write, no shift)."""
    observe = queries.shape[2]
    k = min(new.shape[0], observe)
    slots = torch.arange(end - k, end, device=new.device) % observe
    queries[row, :, slots] = new[new.shape[0] - k :].transpose(0, 1).to(queries.dtype)


def remember_decode(queries: torch.Tensor, m: Any, query: torch.Tensor) -> None:
    """Write each generated token's query [H_q, D] at its request's row, slot position % observe."""
    queries[m.decode_rows, :, m.decode_query_slots] = query[m.decode_tokens].to(queries.dtype)


def compact_all(
    impl: Any,
    layer: Any,
    kv_cache: torch.Tensor,
    m: Any,
    positions: torch.Tensor,
    queries: torch.Tensor | None,
    items: list[tuple[int, ...]],
    identity: bool,
) -> None:
    """Run the due compactions `items` over the layer's cache (through `impl.pages`), batched: one policy call
    per group of requests that can share a `CompressedStore` view (a protected prompt: each request alone;
    random eviction, which ranks prompt slots by the prompt's end: requests with as many generated tokens;
    otherwise all of them)."""
    if not items:
        return
    pages, spec = impl.pages(kv_cache), layer.rlkv_spec
    if spec.protect_prompt:
        groups = [[item] for item in items]
    elif spec.policy == "random":
        by_generated: dict[int, list[tuple[int, ...]]] = {}
        for item in items:
            by_generated.setdefault(item[4] - item[5], []).append(item)
        groups = list(by_generated.values())
    else:
        groups = [items]
    for group in groups:
        _compact(impl, layer, pages, m, positions, queries, group, identity)


def _compact(
    impl: Any,
    layer: Any,
    pages: PageViews,
    m: Any,
    positions: torch.Tensor,
    queries: torch.Tensor | None,
    items: list[tuple[int, ...]],
    identity: bool,
) -> None:
    """Run the policy over each request's occupied slots; the slots it keeps move, in order, to the front.

    items: (request index, table row, occupied slots, kept slots, tokens, prompt, kept prompt blocks,
    prompt blocks) per request. The requests share one view in a common column frame, as rows of a
    left-padded batch on the transformers path: a request of n tokens sits at columns shifted by
    (longest n - n), so the store's logical length, window and observation queries' columns are shared
    and each row starts at its shift; its slots past its occupied ones are empty (position -1).
    identity: the slots hold the prompt at slot = position (its first compaction).
    """
    from rlkv.cache.static.budget import keep_in_run, policy_view

    d, size, device = impl.head_size, pages.keys.shape[2], pages.keys.device
    spec = layer.rlkv_spec
    columns = list(zip(*items, strict=True))
    requests, rows = (torch.tensor(c, dtype=torch.long, device=device) for c in columns[:2])
    occupied = torch.tensor(columns[2], dtype=torch.long, device=device)
    lengths = torch.tensor(columns[4], dtype=torch.long, device=device)
    pairs = torch.tensor(list(zip(columns[6], columns[7])), dtype=torch.long, device=device)
    width, longest = max(columns[2]), max(columns[4])
    slots = torch.arange(width, device=device)[None, :].expand(len(items), -1)
    exists = slots < occupied[:, None]
    blocks, offsets = slot_blocks(m.block_table, requests, pairs, slots, size)
    blocks = torch.where(exists, blocks, 0)  # empty slots read and write vLLM's null block
    keys = pages.keys[blocks, :, offsets].permute(0, 2, 1, 3).contiguous()  # [B, H_kv, N, D]
    values = pages.values[blocks, :, offsets].permute(0, 2, 1, 3).contiguous()
    held = slots[:, None, :].expand(-1, impl.num_kv_heads, -1) if identity else positions[rows, :, :width]
    shift = longest - lengths
    held = torch.where(exists[:, None, :], held + shift[:, None, None], -1)
    observed = None
    if queries is not None:  # each request's last `count` queries, oldest first, from its ring (`remember`)
        observe = queries.shape[2]
        count = min(observe, longest)
        own = lengths[:, None] - count + torch.arange(count, device=device)[None, :]  # [B, N_q] positions
        q = queries[rows[:, None], :, own % observe].transpose(1, 2)  # [B, H_q, N_q, D]
        q = q.reshape(len(items), impl.num_kv_heads, impl.groups, count, d)
        observed = (q, torch.arange(longest - count, longest, device=device))
    early = columns[5][0] if spec.protect_prompt else 0
    prompt = columns[5][0] + (longest - columns[4][0])  # one prompt end for the group (see compact_all)
    view = policy_view(
        layer.rlkv_layer_index,
        layer.rlkv_head_ids.to(device),
        impl.groups,
        layer.rlkv_settings,
        (keys, values, held),
        observed,
        shift,
        (longest, prompt),
        {},
        unpadded=len(set(columns[2])) == 1 and len(set(columns[4])) == 1,
    )
    buffers = SlotView(impl.slot_tables, rows, width, list(columns[1])) if impl.slot_tables else None
    if buffers is not None:  # the policy's per-slot buffers move with the kept slots
        view._slot_buffers.update(buffers.buffers)
    moved_buffers = tuple(buffers.buffers.values()) if buffers is not None else ()
    keep_in_run(view, layer.rlkv_policy, (keys, values, held), 0, early, early, moved_buffers)
    if buffers is not None:
        buffers.store(compacted=True)
    # kept slots first; empty slots aim at vLLM's null block (never read unmasked): no second gather to keep
    # what it holds
    pages.keys[blocks, :, offsets] = keys.permute(0, 2, 1, 3).to(pages.keys.dtype)
    pages.values[blocks, :, offsets] = values.permute(0, 2, 1, 3).to(pages.values.dtype)
    kept = min(width, positions.shape[2])
    positions[rows, :, :kept] = torch.where(held >= 0, held - shift[:, None, None], -1)[..., :kept]
