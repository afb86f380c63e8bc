"""R-KV (Cai et al. 2025): redundancy-aware decode-time eviction for reasoning models.

Each (row, KV head) holds at most `budget + buffer` evictable tokens: when the buffer is full the
store is scored and cut back to `budget` (observation tokens included). Per KV head:

- importance I: the last `window` (8) cached queries attend to every valid key outside the
  observation window (max over the GQA group of the raw logits, then softmax), max-pooled along
  the keys with `kernel` 7, averaged over the observation queries;
- redundancy R: cosine similarity of the normalised keys (diagonal zeroed); for each token, among
  the keys more similar than `threshold` (0.5) the `recent_exempt` (1) most recent ones are not
  counted (their similarity set to 0); mean similarity per key, softmax over the keys;
- score `lam * I - (1 - lam) * R` (lam 0.1); the observation tokens are always kept.

Departures from the authors' code, on purpose: every batch row is scored on its own keys (their
code scores row 0 for all rows), the prompt is protected when `protect_prompt` is on, a token with
no similar key exempts nothing (their argmax exempts slot 0), and the redundancy matrix is built
in row chunks (memory O(chunk * K) per head instead of O(K^2)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, keep_top_scores
from rlkv.policies.scoring import masked_softmax, observation_attention, observation_window

if TYPE_CHECKING:
    from rlkv.cache import CompressedStore


def key_redundancy(
    keys: torch.Tensor,
    valid: torch.Tensor,
    threshold: float = 0.5,
    recent_exempt: int = 1,
    chunk: int = 1024,
) -> torch.Tensor:
    """R-KV's redundancy score of every slot: FloatTensor [B, H, K], softmax over the valid slots.

    keys: [B, H, K, D]; valid: BoolTensor [B, H, K] (empty and padding slots take no part and
    score 0). Valid slots are in increasing position order (the store's invariant), so the most
    recent similar keys are the last ones in slot order.
    S[i, j] = cos(k_i, k_j) with S[i, i] = 0; for each row i the `recent_exempt` most recent keys j
    with S[i, j] > threshold (>= 0) get S[i, j] = 0; R_j = softmax_j(mean_i S[i, j]) over valid i, j.
    The column sums of S come from the sum of the normalised keys (O(K * D)); only the exemption
    needs S, built `chunk` rows at a time: memory O(B * H * chunk * K), none when recent_exempt = 0.
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (rows of the similarity matrix per step)")
    if threshold < 0:
        raise ValueError(
            f"threshold={threshold} must be >= 0 (cosine similarity above which keys are similar)"
        )
    normed = keys.float() / (keys.float().norm(dim=-1, keepdim=True) + 1e-8)
    normed = normed * valid[..., None]  # empty slots: zero vectors, so S = 0 on their rows and columns
    slots = keys.shape[2]
    # sum_i S[i, j] = k_j . sum_i k_i - k_j . k_j: the column sums need no K x K matrix
    column_sum = (normed * normed.sum(dim=2, keepdim=True)).sum(-1) - (normed * normed).sum(-1)
    exempt = min(int(recent_exempt), slots)
    if exempt > 0:
        # columns newest first: the first similar column of a row is its most recent similar key
        newest_first = normed.flip(2).transpose(-1, -2)
        column_rank = torch.arange(slots, 0, -1, device=keys.device, dtype=torch.float32)
        for start in range(0, slots, chunk):
            stop = min(start + chunk, slots)
            sim = normed[:, :, start:stop] @ newest_first  # [B, H, C, K]; column c is slot K - 1 - c
            rows = torch.arange(stop - start, device=keys.device)
            sim[:, :, rows, slots - 1 - start - rows] = 0.0  # a key is not similar to itself
            similar = sim > threshold
            if exempt == 1:
                column = similar.view(torch.uint8).argmax(dim=-1, keepdim=True)  # first True (or 0)
                hit = similar.gather(-1, column)
            else:
                rank, column = (similar * column_rank).topk(exempt, dim=-1)
                hit = rank > 0
            exempted = sim.gather(-1, column) * hit  # [B, H, C, exempt]
            column_sum.scatter_add_(-1, (slots - 1 - column).flatten(2), -exempted.flatten(2))
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (column_sum / count).masked_fill(~valid, float("-inf"))
    return masked_softmax(mean)


@register_policy("rkv")
class RKVPolicy(CompressionPolicy):
    """R-KV: importance minus redundancy, compressing to `budget` every time `buffer` tokens accumulate.

    window: observation queries (a = 8), their tokens always kept.
    kernel: max-pooling window along the keys (7).
    lam: weight of importance in `lam * I - (1 - lam) * R` (0.1).
    threshold: cosine similarity above which keys count as similar (0.5).
    recent_exempt: most recent similar keys exempted per token (beta = 1).
    buffer: tokens added between compressions (128).
    redundancy_chunk: rows of the similarity matrix computed at once (memory vs speed).
    Default budget (no `CompressionConfig.budget`): 1024 tokens per head.
    """

    default_budget = 1024

    def __init__(
        self,
        window: int = 8,
        kernel: int = 7,
        lam: float = 0.1,
        threshold: float = 0.5,
        recent_exempt: int = 1,
        buffer: int = 128,
        redundancy_chunk: int = 1024,
    ):
        if window < 1:
            raise ValueError(f"{self.name}: window={window} must be >= 1 (observation queries)")
        if kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"{self.name}: kernel={kernel} must be a positive odd number (max-pool window)")
        if not 0.0 <= lam <= 1.0:
            raise ValueError(f"{self.name}: lam={lam} must be in [0, 1] (importance weight)")
        if threshold < 0:
            raise ValueError(f"{self.name}: threshold={threshold} must be >= 0 (key cosine similarity)")
        if recent_exempt < 0:
            raise ValueError(f"{self.name}: recent_exempt={recent_exempt} must be >= 0")
        if buffer < 0:
            raise ValueError(f"{self.name}: buffer={buffer} must be >= 0 (tokens added between compressions)")
        if redundancy_chunk < 1:
            raise ValueError(f"{self.name}: redundancy_chunk={redundancy_chunk} must be >= 1")
        self.window = int(window)
        self.kernel = int(kernel)
        self.lam = float(lam)
        self.threshold = float(threshold)
        self.recent_exempt = int(recent_exempt)
        self.buffer = int(buffer)
        self.redundancy_chunk = int(redundancy_chunk)
        self.observe_queries = self.window

    def due(self, store: CompressedStore) -> torch.Tensor:
        """BoolTensor [B, H_c]: (row, head) pairs whose buffer is full (budget + buffer evictable tokens)."""
        return store.num_evictable() >= store.budget[:, None] + max(self.buffer, 1)

    def should_compress(self, store: CompressedStore) -> bool:
        return store.budget is not None and bool(self.due(store).any())

    def importance(self, store: CompressedStore) -> torch.Tensor:
        """I: FloatTensor [B, H_c, K], 0 on the observation window and empty slots."""
        return observation_attention(
            store, exclude_window=True, group_pool="max", kernel=self.kernel, key_pool="max"
        )

    def redundancy(self, store: CompressedStore) -> torch.Tensor:
        """R: FloatTensor [B, H_c, K], a softmax over each (row, head)'s valid slots."""
        return key_redundancy(
            store.keys,
            store.valid(),
            self.threshold,
            self.recent_exempt,
            self.redundancy_chunk,
        )

    def scores(self, store: CompressedStore) -> torch.Tensor:
        """`lam * I - (1 - lam) * R`: FloatTensor [B, H_c, K] (higher = keep)."""
        return self.lam * self.importance(store) - (1.0 - self.lam) * self.redundancy(store)

    def select(self, store: CompressedStore) -> torch.Tensor:
        scores = self.scores(store).masked_fill(observation_window(store), float("inf"))
        keep = keep_top_scores(store, scores)
        # (row, head) pairs whose buffer is not full keep everything, as they would running alone
        return torch.where(self.due(store)[..., None], keep, store.valid())
