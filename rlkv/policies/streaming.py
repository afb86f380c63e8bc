"""Streaming (sink + local window) eviction: RLKV's inference policy for compressed heads."""

from __future__ import annotations

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, keep_forced_only


@register_policy("streaming")
class StreamingPolicy(CompressionPolicy):
    """Keep the first `sink` and last `window` tokens of each row (plus the protected prompt).

    Sink and window sizes come from `CompressionConfig.sink` / `.window` (RLKV: 16 + 64); the
    budget is ignored. Compresses as soon as anything outside that set is stored.
    """

    selects_by_position = True

    def should_compress(self, store: PolicyStore) -> bool:
        # a row stores a slot outside its forced set
        return any(n > f for n, f in zip(store.slot_counts, store.forced_counts(), strict=True))

    def kept_counts(self, store: PolicyStore) -> list[int]:
        return store.forced_counts()

    def select(self, store: PolicyStore) -> torch.Tensor:
        return keep_forced_only(store)
