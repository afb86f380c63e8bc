"""K-norm (Devoto et al. 2024): keys with a small L2 norm draw the most attention, so keep those.

The worked example of CONTRIBUTING.md ("Adding a policy"): one file, one registered class,
scores from what the store holds, selection by the shared `select_top_scores` (`keep_top_scores`'
slots, as indices where the host knows their count).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, select_top_scores, top_scores_counts


@register_policy("knorm")
@dataclass(eq=False, kw_only=True)
class KeyNormPolicy(CompressionPolicy):
    """Keep the evictable tokens whose keys have the smallest L2 norm (per row and KV head).

    buffer: tokens allowed above the budget before compressing again (0: compress every step).
    """

    default_budget = 0.2  # 20% of each row's real tokens + sink + window, as `h2o`

    buffer: int = 0

    def __post_init__(self) -> None:  # every policy_kwargs key is a field; validate them here
        if int(self.buffer) != self.buffer or self.buffer < 0:
            raise ValueError(f"knorm: buffer={self.buffer!r} must be an int >= 0")
        self.buffer = int(self.buffer)

    def should_compress(self, store: PolicyStore) -> bool:  # host ints only: no read of the device
        budget = store.budget_counts()
        if budget is None:
            return False
        return any(n > b + self.buffer for n, b in zip(store.evictable_counts(), budget, strict=True))

    def kept_counts(self, store: PolicyStore) -> list[int]:
        return top_scores_counts(store)

    def select(self, store: PolicyStore) -> torch.Tensor:
        # [B, H_c, K], smaller norm = higher score; `vector_norm` reduces in float32 without a float
        # copy of bf16 keys, and without `Tensor.norm`'s Python wrapper (per compaction, on the decode path)
        scores = torch.linalg.vector_norm(store.keys, dim=-1, dtype=torch.float32).neg_()
        return select_top_scores(store, scores)
