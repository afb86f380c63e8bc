"""H2O (Heavy-Hitter Oracle, Zhang et al. 2023): keep the keys that received the most attention, plus recent ones.

Score of a kept slot = the attention it has received so far, summed over every query that saw it
(prompt queries included) and over the query heads of its KV head's GQA group. The cache hands the
policy each forward's attention probabilities (`observe_attention`); the running sums live in a slot
buffer, so they follow the slots through evictions. Decode-time: as soon as a (row, head) holds
more evictable tokens than its budget, the lowest-scoring ones go, one step at a time.

Budget split (paper: half heavy hitters, half recent tokens): the newest
`max(window, round(recent_ratio * budget))` evictable tokens of each row are always kept, the rest
of the budget goes to the heavy hitters. The config's `window` is part of that recent share; the
config's `sink` tokens are kept on top of the paper's method (they spend budget like any token).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, select_top_scores, top_scores_counts

ACCUMULATED = "h2o_accumulated_attention"


@register_policy("h2o")
@dataclass(eq=False, kw_only=True)
class H2OPolicy(CompressionPolicy):
    """Accumulated-attention heavy hitters + recent window, evicting whenever a head is over budget.

    recent_ratio: share of the budget reserved for the most recent tokens (paper: 0.5); the
        config's `window` is a lower bound of that share.
    Default budget (no `CompressionConfig.budget`): 0.2 of the current length + sink + window, the
    paper's 20% cache (10% heavy + 10% recent).
    """

    observe_attention = True
    default_budget = 0.2

    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(
                f"h2o: recent_ratio={self.recent_ratio} must lie in [0, 1] (share of the budget kept as recent tokens)"
            )
        self.recent_ratio = float(self.recent_ratio)

    def on_attention(self, store: PolicyStore, probs: torch.Tensor) -> None:
        # probs [B, H_c, G, Q, K]: zero on empty/masked slots and for padding queries
        store.slot_buffer(ACCUMULATED).add_(probs.sum(dim=(2, 3)))

    def scores(self, store: PolicyStore) -> torch.Tensor:
        """FloatTensor [B, H_c, K]: accumulated attention, +inf on each row's recent share."""
        accumulated = store.slot_buffer(ACCUMULATED)
        recent = torch.round(self.recent_ratio * store.budget.double()).long().clamp(min=store.window)
        is_recent = store.positions >= (store.logical_length - recent)[:, None, None]
        return accumulated.masked_fill(is_recent & store.valid(), float("inf"))

    def kept_counts(self, store: PolicyStore) -> list[int]:
        return top_scores_counts(store)

    def select(self, store: PolicyStore) -> torch.Tensor:
        return select_top_scores(store, self.scores(store))
