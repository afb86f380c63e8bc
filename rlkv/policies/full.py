"""The no-op policy: compressed heads keep every token (for tests and as a reference)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy

if TYPE_CHECKING:
    from rlkv.cache import CompressedStore


@register_policy("full")
class FullPolicy(CompressionPolicy):
    """Never evicts: the compressed store grows like a full cache."""

    def should_compress(self, store: CompressedStore) -> bool:
        return False

    def select(self, store: CompressedStore) -> torch.Tensor:
        return store.valid()
