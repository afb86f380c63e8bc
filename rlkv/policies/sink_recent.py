"""Sink + most recent tokens up to a budget: StreamingLLM sized by the shared budget.

`streaming` keeps exactly sink + window (RLKV's compressed heads) and ignores budgets; baselines
at RLKV's dynamic budget `(1 - s) * length` need the recent part to grow with the budget, which is
this policy (the eval harness's `streaming` baseline).
"""

from __future__ import annotations

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, keep_top_scores, top_scores_counts


@register_policy("sink-recent")
class SinkRecentPolicy(CompressionPolicy):
    """Keep the sink and the most recent evictable tokens that fit `store.budget` (newest first)."""

    selects_by_position = True

    def kept_counts(self, store: PolicyStore) -> list[int]:
        return top_scores_counts(store)

    def select(self, store: PolicyStore) -> torch.Tensor:
        return keep_top_scores(store, store.positions.float())
