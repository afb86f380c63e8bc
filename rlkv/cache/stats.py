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


def head_mixed_stats(cache: Any) -> list[CacheStats]:
    """Per batch row of a `HeadMixedCache` (see `HeadMixedCache.stats`); [] before the first forward."""
    layer0 = cache.layers[0]
    some = layer0.keys if layer0.keys is not None else (layer0.store.keys if layer0.store else None)
    if some is None:
        return []
    batch = some.shape[0]
    resident, full = cache.resident_bytes() // batch, cache.full_resident_bytes() // batch
    rows = []
    # host counts only (no read of the device): row starts, slot counts and evictions are Python ints
    for b in range(batch):
        kept = evicted = real = 0
        for layer in cache.layers:
            real = layer.logical_length - (layer.row_start_host[b] if layer.row_start_host is not None else 0)
            kept += int(layer.full_idx.numel()) * real
            store = layer.store
            if store is not None and store.positions is not None:
                heads = store.positions.shape[1]
                kept += sum(store.head_counts[b]) if store.head_counts else heads * store.slot_counts[b]
                evicted += store.evicted_host[b]
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


def full_cache_stats(cache: Any, attention_mask: torch.Tensor) -> list[CacheStats]:
    """Per-row stats of a plain (full, e.g. DynamicCache) cache, from its tensors' storage."""
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values) if t is not None]
    batch = attention_mask.shape[0]
    resident = sum(t.untyped_storage().nbytes() for t in tensors) // batch
    length = cache.get_seq_length()
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
