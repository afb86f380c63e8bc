"""SnapKV (Li et al. 2024), decode-adapted as R-KV's baseline: attention-only importance every `buffer` steps.

SnapKV scores the cache with the attention of its last observation-window queries. Adapted to
decoding the way R-KV's paper runs it as a baseline (seeds 001/004): once a (row, head) holds
`budget + buffer` evictable tokens, score every evictable token outside the observation window,
keep the top `budget - window` plus the `window` observation tokens (always kept). Importance per
KV head: softmax over the non-window keys of each observation query, pooled over the query heads
of the GQA group, max-pooled along the keys (kernel 7), averaged over the observation queries:
R-KV's score without its redundancy term.

Defaults follow R-KV's baseline (window 8, max-pool kernel 7, max over the group's raw logits
before the softmax, buffer 128). SnapKV's own paper setting: `window=32, pooling="avg",
group_pool="mean"` (mean over the group of each query head's softmax, SnapKV/AdaKV style).
The softmax runs over every valid key outside the window, protected prompt included (SnapKV
compresses the prompt with the same attention distribution); protected tokens are kept anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import PolicyStore
from rlkv.policies.helpers.scoring import (
    WindowedBufferPolicy,
    check_buffer,
    check_window_and_kernel,
    masked_softmax,
    observation_logits,
    pool_query_groups,
    pooled_importance,
)


@register_policy("snapkv")
@dataclass(eq=False, kw_only=True)
class SnapKVPolicy(WindowedBufferPolicy):
    """Observation-window attention importance, compressing every `buffer` steps once over budget.

    window: observation queries (8, R-KV's baseline; 32 in SnapKV's paper), their tokens kept.
    kernel / pooling: pooling along the keys (7, "max"; SnapKV's code uses "avg").
    group_pool: GQA pooling, "max" of the raw logits before the softmax (R-KV) or "mean" of the
        query heads' softmax probabilities (SnapKV with GQA).
    buffer: tokens added between compressions (128).
    Default budget (no `CompressionConfig.budget`): 1024 tokens per head.
    """

    default_budget = 1024

    window: int = 8
    kernel: int = 7
    pooling: Literal["max", "avg"] = "max"
    group_pool: Literal["max", "mean"] = "max"
    buffer: int = 128

    def __post_init__(self) -> None:
        check_window_and_kernel(self.name, "window", self.window, self.kernel)
        if self.pooling not in ("max", "avg"):
            raise ValueError(
                f"snapkv: pooling={self.pooling!r}: use 'max' (R-KV's baseline) or 'avg' (SnapKV)"
            )
        if self.group_pool not in ("max", "mean"):
            raise ValueError(f"snapkv: group_pool={self.group_pool!r}: use 'max' (R-KV) or 'mean' (SnapKV)")
        check_buffer(self.name, self.buffer)
        self.window, self.kernel, self.buffer = int(self.window), int(self.kernel), int(self.buffer)

    @property
    def observe_queries(self) -> int:
        """The observation window: the cache keeps the last `window` queries."""
        return self.window

    def scores(self, store: PolicyStore) -> torch.Tensor:
        """Importance FloatTensor [B, H_c, K]: 0 on the observation window and invalid slots."""
        logits = observation_logits(store, exclude_window=True)
        if self.group_pool == "max":
            probs = masked_softmax(pool_query_groups(logits, "max"))
        else:
            probs = masked_softmax(logits).mean(dim=2)
        return pooled_importance(store, probs, self.kernel, self.pooling)
