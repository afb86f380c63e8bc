"""The no-op policy: compressed heads keep every token (for tests and as a reference)."""

from __future__ import annotations

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore


@register_policy("full")
class FullPolicy(CompressionPolicy):
    """Never evicts: the compressed store grows like a full cache."""

    def should_compress(self, store: PolicyStore) -> bool:
        return False

    def select(self, store: PolicyStore) -> torch.Tensor:
        return store.valid()
