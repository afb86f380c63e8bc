"""How the split's attention parts fall into vLLM's KV cache groups, and a layout that pads no full part.

vLLM (0.32, `kv_cache_utils`, a private rule read from its code and checked against the groups it builds by
the vLLM tier and `python -m benchmarks --suite vllm --vllm-parts padding`) gives every KV cache group the
same number of layers, `g`: layers of one spec form a bucket, `g` is the smallest bucket's size, or the
largest's when that is under 1.5x the smallest; each bucket is cut into groups of `g`, the last padded.
All groups share one block pool, a block costing `g` pages. A full-attention group's blocks grow with the
sequence, so padding in the full kind costs memory on every token; a compressed group holds a bounded number
of blocks per request, so its padding costs almost nothing.

With one compressed bucket, uneven masks lose much of the saving: Qwen2.5-7B's geometry at s=0.6 has 45
full and 67 compressed parts, `g` = 67 and the full group is padded by 22 (a third of the ideal saving
lost). `plan_groups` spreads the compressed parts over several buckets (specs that differ only in a
`bucket` field) so that `g` divides the full parts: here two buckets of 34 and 33, `g` = 45, no full padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

KEEP_SAVING = 0.9  # a layout keeping at least this share of the mask's ideal KV saving needs no other
GROWTH = 1.5  # vLLM's heuristic: the largest bucket's size is used when under GROWTH x the smallest


def vllm_group_size(bucket_sizes: list[int]) -> int:
    """Layers per KV cache group vLLM picks for buckets (layers of one spec) of these sizes."""
    low, high = min(bucket_sizes), max(bucket_sizes)
    return high if high < low * GROWTH else low


@dataclass(frozen=True)
class GroupPlan:
    """Compressed parts per spec bucket and what vLLM builds of them with `full` full-attention parts.

    buckets: compressed parts in each bucket (bucket i holds the next buckets[i] compressed parts, in layer
    order); group_size: vLLM's `g`; groups: KV cache groups in all; saving_kept: the share of the mask's
    ideal KV saving per token kept (1.0: the full groups are not padded).
    """

    full: int
    buckets: tuple[int, ...]
    group_size: int
    groups: int
    saving_kept: float


def evaluate(full: int, buckets: tuple[int, ...]) -> GroupPlan:
    """The `GroupPlan` vLLM makes of `full` full parts and compressed buckets `buckets`."""
    sizes = [full, *buckets] if full else list(buckets)
    g = vllm_group_size(sizes)
    groups = sum(math.ceil(size / g) for size in sizes)
    compressed = sum(buckets)
    if not full or not compressed:
        return GroupPlan(full, buckets, g, groups, 1.0)
    full_slots = math.ceil(full / g) * g  # pages a token costs in the full kind (stock: full + compressed)
    kept = (full + compressed - full_slots) / compressed
    return GroupPlan(full, buckets, g, groups, max(0.0, kept))


def _near_equal(total: int, count: int) -> tuple[int, ...]:
    base, extra = divmod(total, count)
    return tuple(base + 1 if i < extra else base for i in range(count))


def _candidates(full: int, compressed: int) -> list[tuple[int, ...]]:
    """Bucket layouts worth evaluating: `k` near-equal buckets, and a bucket of `d` (a divisor of the full
    parts: vLLM then picks `g` = d) with the rest in one or more buckets of at least `d`."""
    layouts = {_near_equal(compressed, k) for k in range(1, min(compressed, 8) + 1)}
    for d in range(1, min(full, compressed) + 1):
        if full % d:
            continue
        rest = compressed - d
        if rest == 0:
            layouts.add((d,))
        elif rest >= d:
            layouts.add((d, rest))
    return sorted(layouts)


def plan_groups(full: int, compressed: int) -> GroupPlan:
    """The compressed buckets to build for `full` full and `compressed` compressed attention parts.

    One bucket when vLLM's grouping of it keeps `KEEP_SAVING` of the ideal saving; else the layout with the
    fewest groups (then buckets) among those that keep it; else the one keeping the most.
    """
    if not compressed:
        return evaluate(full, ())
    plain = evaluate(full, (compressed,))
    if plain.saving_kept >= KEEP_SAVING:
        return plain
    plans = [evaluate(full, layout) for layout in _candidates(full, compressed)]
    keeping = [p for p in plans if p.saving_kept >= KEEP_SAVING]
    if keeping:
        return min(keeping, key=lambda p: (p.groups, -p.saving_kept, len(p.buckets)))
    return max(plans, key=lambda p: (p.saving_kept, -p.groups))


def bucket_of_parts(plan: GroupPlan) -> list[int]:
    """The bucket of each compressed part, the parts in layer order (bucket i takes the next buckets[i])."""
    return [i for i, size in enumerate(plan.buckets) for _ in range(size)]
