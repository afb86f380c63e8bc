"""`CacheStats`: the one shape of KV-cache statistics (a `HeadMixedCache`, `generate`, rollouts).

A row of `HeadMixedCache.stats()` / `GenerationOutput.cache_stats` describes one sequence; a
rollout batch's `kv` covers the whole batch and adds the peak seen between forwards.
It reads like a mapping too (`stats["evictions"]`, `dict(stats)`), the shape it had before.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch


@dataclass(frozen=True)
class CacheStats(Mapping):
    """KV memory of one sequence, or of a batch (`batch_size` > 1: bytes and counts of all rows).

    resident_bytes: bytes the cache's tensors hold (a row's share of the batched storage);
    full_resident_bytes: what a full (DynamicCache) cache holds for the same tokens;
    logical_length: tokens seen (a row: real tokens; a batch: columns, padding included);
    kept_tokens / evictions: KV entries kept / evicted, summed over layers and KV heads;
    peak_bytes: the largest resident_bytes seen between forwards, when it was tracked (rollouts).
    """

    resident_bytes: int
    full_resident_bytes: int
    logical_length: int
    kept_tokens: int
    evictions: int
    peak_bytes: int | None = None
    batch_size: int = 1

    @property
    def resident_ratio(self) -> float:
        """resident_bytes / full_resident_bytes (1.0 for a full cache)."""
        return self.resident_bytes / self.full_resident_bytes if self.full_resident_bytes else 1.0

    # read-only mapping over the fields ---------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key not in _FIELDS:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(_FIELDS)

    def __len__(self) -> int:
        return len(_FIELDS)


_FIELDS = tuple(f.name for f in fields(CacheStats))


def head_mixed_counts(cache: Any) -> tuple[tuple[Any, ...], ...]:
    """The host counts `head_mixed_stats` reads, as they are now, per layer: (tokens seen, row starts,
    full KV heads, compressed KV heads, slots per row, slots per (row, head) or None, evictions per
    row). The lists are ones the cache replaces rather than mutates, so this holds references, costs
    O(layers) and reads nothing from the device: `generate` takes one at every step."""
    counts = []
    for layer in cache.layers:
        store = layer.store
        filled = store is not None and store.positions is not None
        counts.append(
            (
                layer.logical_length,
                layer.row_start_host,
                int(layer.full_idx.numel()),
                store.positions.shape[1] if filled else 0,
                store.slot_counts if filled else None,
                store.head_counts if filled else None,
                store.evicted_host if filled else None,
            )
        )
    return tuple(counts)


def head_mixed_stats(cache: Any, counts: tuple[tuple[Any, ...], ...] | None = None) -> list[CacheStats]:
    """Per batch row of a `HeadMixedCache` (see `HeadMixedCache.stats`); [] before the first forward.

    counts: a `head_mixed_counts(cache)` taken earlier (None: now). Token counts, evictions and
    full_resident_bytes describe that moment; resident_bytes is read from the storage now.
    """
    layer0 = cache.layers[0]
    some = layer0.keys if layer0.keys is not None else (layer0.store.keys if layer0.store else None)
    if some is None:
        return []
    batch, head_dim = some.shape[0], some.shape[-1]
    counts = head_mixed_counts(cache) if counts is None else counts
    resident = cache.resident_bytes() // batch
    # what a full cache holds for those tokens: keys + values of every KV head and column
    per_column = 2 * head_dim * some.element_size()
    full = sum(layer.num_kv_heads * length * per_column for layer, (length, *_) in zip(cache.layers, counts))
    rows = []
    # host counts only (no read of the device): row starts, slot counts and evictions are Python ints
    for b in range(batch):
        kept = evicted = real = 0
        for length, starts, num_full, heads, slots, per_head, evictions in counts:
            real = length - (starts[b] if starts is not None else 0)
            kept += num_full * real
            if slots is not None:
                kept += sum(per_head[b]) if per_head else heads * slots[b]
                evicted += evictions[b]
        rows.append(
            CacheStats(
                resident_bytes=resident,
                full_resident_bytes=full,
                logical_length=real,
                kept_tokens=kept,
                evictions=evicted,
            )
        )
    return rows


def full_cache_stats(cache: Any, attention_mask: torch.Tensor, length: int | None = None) -> list[CacheStats]:
    """Per-row stats of a plain (full, e.g. DynamicCache) cache, from its tensors' storage.

    length: the columns the cache held at the moment described (None: now); a plain cache stores
    exactly its columns, so the bytes of an earlier moment are the per-column bytes times `length`.
    """
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    batch = attention_mask.shape[0]
    now = cache.get_seq_length()
    length = now if length is None else length
    stored = sum(t.untyped_storage().nbytes() for t in tensors)
    resident = (stored if length == now else stored // max(now, 1) * length) // batch
    heads = sum(t.shape[1] for t in tensors) // 2
    pads = (attention_mask == 0).sum(1).tolist()
    return [
        CacheStats(
            resident_bytes=resident,
            full_resident_bytes=resident,
            logical_length=length - pad,
            kept_tokens=heads * (length - pad),
            evictions=0,
        )
        for pad in pads
    ]
