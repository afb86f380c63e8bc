"""RPC (Reasoning Path Compression, seed 000): periodic compression scored by a selector window.

Schedule: the first compression runs once `interval + selector_window` tokens (P + R) were
generated, then every `interval` tokens. Selectors are the last R queries (R - 1 cached ones plus
the current), and their tokens are always kept. Candidates are the other evictable tokens (the
prompt is protected by default, as in the paper, which never evicts it).

Score of a candidate j of a layer (one selection per layer, shared by all its compressed heads):
    s_j = avgpool_k( 1/(H G) * sum_{heads} sum_{i in selectors} softmax_{j in candidates}(q_i . k_j / sqrt(D)) )
with the softmax over the candidate region only and the pooling over adjacent candidates (zero
padding at the ends, divisor k, kernel 7), as in the authors' code. H G counts the query heads of
the layer's compressed KV heads: all heads in the paper's setting; with a head mask, the full
heads keep everything and take no part in the selection.

Budget: RPC's own target after cycle n is `n * int(P / c)` kept candidates plus the R selectors
(the paper's ratio c = 4 over the generated part; sink/window tokens spend the same target). A
`CompressionConfig.budget` (tokens or ratio) overrides that target; the schedule stays periodic,
so between compressions a head holds up to budget + P evictable tokens (P plays the buffer's role).
With `protect_prompt=False` the prompt joins the candidates and the target covers it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, keep_top_scores, top_scores_counts
from rlkv.policies.helpers.scoring import (
    NEG_INF,
    check_window_and_kernel,
    masked_softmax,
    observation_logits,
    observation_window,
    pool_along_keys,
)

CYCLES = "rpc_cycles"


@register_policy("rpc")
@dataclass(eq=False, kw_only=True)
class RPCPolicy(CompressionPolicy):
    """Periodic, layer-wise selection from a selector window of recent queries (RPC).

    interval: P, generated tokens between compressions (paper: 1024 or 4096; default 4096).
    selector_window: R, recent queries that score the candidates, their tokens always kept (32).
    ratio: c, target compression of the generated part (4: keep n * P / c after cycle n).
    kernel: local pooling window along the candidates (7); pooling "avg" (paper) or "max".
    """

    interval: int = 4096
    selector_window: int = 32
    ratio: float = 4.0
    kernel: int = 7
    pooling: Literal["avg", "max"] = "avg"

    def __post_init__(self) -> None:
        if self.interval < 1:
            raise ValueError(
                f"rpc: interval={self.interval} must be >= 1 (generated tokens between compressions)"
            )
        check_window_and_kernel(self.name, "selector_window", self.selector_window, self.kernel)
        if self.ratio < 1:
            raise ValueError(
                f"rpc: ratio={self.ratio} must be >= 1 (compression ratio of the generated part)"
            )
        if self.pooling not in ("avg", "max"):
            raise ValueError(f"rpc: pooling={self.pooling!r}: use 'avg' (paper) or 'max'")
        self.interval, self.selector_window, self.kernel = (
            int(self.interval),
            int(self.selector_window),
            int(self.kernel),
        )
        self.ratio = float(self.ratio)

    @property
    def kept_per_cycle(self) -> int:
        """T = P / c generated tokens kept per cycle, as int(P / c) in the paper's code."""
        return int(self.interval / self.ratio)

    @property
    def observe_queries(self) -> int:
        """The selector window: the cache keeps the last `selector_window` queries."""
        return self.selector_window

    def should_compress(self, store: PolicyStore) -> bool:
        cycles = store.state.get(CYCLES, 0)
        return store.num_generated >= (cycles + 1) * self.interval + self.selector_window

    def kept_counts(self, store: PolicyStore) -> list[int]:
        """`keep_top_scores`' count at `target` (a per-layer selection: every head keeps as many)."""
        budget = store.budget_counts()
        if budget is None:
            cycles = store.state.get(CYCLES, 0) + 1
            budget = [cycles * self.kept_per_cycle + self.selector_window] * len(store.slot_counts)
        return top_scores_counts(store, budget)

    def target(self, store: PolicyStore) -> torch.Tensor:
        """LongTensor[B]: evictable tokens to keep per row at the next compression."""
        if store.budget is not None:
            return store.budget
        cycles = store.state.get(CYCLES, 0) + 1
        kept = cycles * self.kept_per_cycle + self.selector_window
        return torch.full_like(store.valid_length, kept)

    def scores(self, store: PolicyStore) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores FloatTensor [B, K], selectors BoolTensor [B, K]) for the layer's slots.

        Scores are pooled importance on candidates and 0 elsewhere; selectors mark the tokens of
        the selector window (valid slots at the cached queries' positions).
        """
        # the heads of a layer hold the same positions: every selection so far was per layer
        selectors = observation_window(store)
        candidates = store.evictable() & ~selectors
        logits = observation_logits(store).masked_fill(~candidates[:, :, None, None, :], NEG_INF)
        per_layer = masked_softmax(logits).sum(dim=3).mean(dim=(1, 2))  # sum over selectors, mean over heads
        pooled = pool_along_keys(per_layer[:, None], self.kernel, self.pooling, candidates[:, :1])[:, 0]
        return pooled, selectors[:, 0]

    def select(self, store: PolicyStore) -> torch.Tensor:
        target = self.target(store)
        store.state[CYCLES] = store.state.get(CYCLES, 0) + 1
        scores, selectors = self.scores(store)
        keep = keep_top_scores(store, scores.masked_fill(selectors, float("inf")), target)
        return keep[:, 0]
