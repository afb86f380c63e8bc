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

from dataclasses import dataclass

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import PolicyStore
from rlkv.policies.helpers.scoring import (
    WindowedBufferPolicy,
    check_buffer,
    check_window_and_kernel,
    masked_softmax,
    observation_attention,
)


def key_redundancy(
    keys: torch.Tensor,
    valid: torch.Tensor | None,
    threshold: float = 0.5,
    recent_exempt: int = 1,
    chunk: int = 256,
) -> torch.Tensor:
    """R-KV's redundancy score of every slot: FloatTensor [B, H, K], softmax over the valid slots.

    keys: [B, H, K, D]; valid: BoolTensor [B, H, K] (empty and padding slots take no part and
    score 0), or None when every slot is valid (no mask built). Valid slots are in increasing position
    order (the store's invariant), so the most recent similar keys are the last ones in slot order.
    S[i, j] = cos(k_i, k_j) with S[i, i] = 0; for each row i the `recent_exempt` most recent keys j
    with S[i, j] > threshold (>= 0) get S[i, j] = 0; R_j = softmax_j(mean_i S[i, j]) over valid i, j.
    When K <= `chunk` and recent_exempt = 1, S is built once and serves both its column sums and
    the exemption. Otherwise the column sums come from the sum of the normalised keys (O(K * D)) and
    only the exemption needs S: in `chunk` x `chunk` blocks above the diagonal for recent_exempt = 1
    (memory O(B * H * chunk^2)), `chunk` rows at a time otherwise (O(B * H * chunk * K)).
    """
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (rows of the similarity matrix per step)")
    if threshold < 0:
        raise ValueError(
            f"threshold={threshold} must be >= 0 (cosine similarity above which keys are similar)"
        )
    keys = keys.float()
    # not `Tensor.norm`: on CPU its Python wrapper costs more than the reduction at these sizes
    normed = keys / (torch.linalg.vector_norm(keys, dim=-1, keepdim=True) + 1e-8)
    if valid is not None:
        normed = normed * valid[..., None]  # empty slots: zero vectors, so S = 0 on their rows and columns
    slots = keys.shape[2]
    exempt = min(int(recent_exempt), slots)
    if exempt == 1 and slots <= chunk:  # one block: S whole, its column sums and the exemption from it
        column_sum = _one_block_redundancy(normed, threshold)
    else:
        # sum_i S[i, j] = k_j . sum_i k_i - k_j . k_j: the column sums need no K x K matrix
        column_sum = (normed * normed.sum(dim=2, keepdim=True)).sum(-1) - (normed * normed).sum(-1)
        if exempt == 1:
            column_sum -= _most_recent_similar(normed, threshold, chunk)
        elif exempt > 1:
            column_sum -= _recent_similar(normed, threshold, exempt, chunk)
    if valid is None:
        return torch.softmax(column_sum / max(slots, 1), dim=-1)
    count = valid.sum(dim=-1, keepdim=True).clamp(min=1)
    mean = (column_sum / count).masked_fill(~valid, float("-inf"))
    return masked_softmax(mean)


def _one_block_redundancy(normed: torch.Tensor, threshold: float) -> torch.Tensor:
    """sum_i S[i, j] with each row's most recent similar key exempted, from one K x K matrix S (the
    store fits one `chunk`): [B, H, K]. The same rule as `_most_recent_similar`."""
    slots = normed.shape[2]
    sim = normed @ normed.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()  # a key is not similar to itself
    rank = torch.arange(1, slots + 1, device=normed.device, dtype=normed.dtype)  # slot j -> j + 1
    last = ((sim - threshold).relu_().sign_() * rank).amax(-1, keepdim=True)  # 0: no similar key
    partner = (last - 1).clamp_(min=0).long()
    exempted = sim.gather(-1, partner) * (last > 0)
    return sim.sum(dim=-2).scatter_add_(-1, partner[..., 0], exempted[..., 0].neg())


def _most_recent_similar(normed: torch.Tensor, threshold: float, chunk: int) -> torch.Tensor:
    """Per slot j, the sum of S[i, j] over the rows i whose most recent similar key is j: [B, H, K].

    normed: unit keys [B, H, K, D] (zero for empty slots). S is symmetric, so only the blocks on and
    above the diagonal are computed (`chunk` x `chunk` keys each); a block serves its rows and,
    transposed, its columns. A row's most recent similar key is its largest similar slot: the max of
    `similar * (slot + 1)`, where `similar` is 1.0 / 0.0 from float ops (relu, sign) and the max is
    `amax`, because on CPU a comparison's bool output, `where` and an indexed `max` each cost several
    times these (measured at K = 144: 20 / 26 / 38 us against 5-11 us).
    """
    slots = normed.shape[2]
    rank = torch.arange(1, slots + 1, device=normed.device, dtype=normed.dtype)  # slot j -> j + 1
    last = torch.zeros(normed.shape[:3], dtype=normed.dtype, device=normed.device)  # 0: no similar key
    for a in range(0, slots, chunk):
        a_end = min(a + chunk, slots)
        for b in range(a, slots, chunk):
            b_end = min(b + chunk, slots)
            sim = normed[:, :, a:a_end] @ normed[:, :, b:b_end].transpose(-1, -2)
            if a == b:
                sim.diagonal(dim1=-2, dim2=-1).zero_()  # a key is not similar to itself
            similar = sim.sub_(threshold).relu_().sign_()  # S > threshold, as 1.0 / 0.0
            rows = last[:, :, a:a_end]
            torch.maximum(rows, (similar * rank[b:b_end]).amax(-1), out=rows)
            if a != b:
                columns = last[:, :, b:b_end]
                torch.maximum(columns, (similar * rank[a:a_end, None]).amax(-2), out=columns)
    partner = (last - 1).clamp_(min=0).long()
    similarity = (normed * normed.gather(2, partner[..., None].expand_as(normed))).sum(-1)
    exempted = torch.zeros(normed.shape[:3], dtype=torch.float32, device=normed.device)
    return exempted.scatter_add_(-1, partner, similarity * (last > 0))


def _recent_similar(normed: torch.Tensor, threshold: float, exempt: int, chunk: int) -> torch.Tensor:
    """Like `_most_recent_similar` for the `exempt` > 1 most recent similar keys of each row (rows of S
    built `chunk` at a time, newest-first columns, top-`exempt` of the similar ones)."""
    slots = normed.shape[2]
    newest_first = normed.flip(2).transpose(-1, -2)  # column c is slot K - 1 - c
    column_rank = torch.arange(slots, 0, -1, device=normed.device, dtype=torch.float32)
    exempted = torch.zeros(normed.shape[:3], dtype=torch.float32, device=normed.device)
    for start in range(0, slots, chunk):
        stop = min(start + chunk, slots)
        sim = normed[:, :, start:stop] @ newest_first  # [B, H, C, K]
        rows = torch.arange(stop - start, device=normed.device)
        sim[:, :, rows, slots - 1 - start - rows] = 0.0  # a key is not similar to itself
        rank, column = ((sim > threshold) * column_rank).topk(exempt, dim=-1)
        similarity = sim.gather(-1, column) * (rank > 0)  # [B, H, C, exempt]
        exempted.scatter_add_(-1, (slots - 1 - column).flatten(2), similarity.flatten(2))
    return exempted


@register_policy("rkv")
@dataclass(eq=False, kw_only=True)
class RKVPolicy(WindowedBufferPolicy):
    """R-KV: importance minus redundancy, compressing to `budget` every time `buffer` tokens accumulate.

    window: observation queries (a = 8), their tokens always kept.
    kernel: max-pooling window along the keys (7).
    lam: weight of importance in `lam * I - (1 - lam) * R` (0.1).
    threshold: cosine similarity above which keys count as similar (0.5).
    recent_exempt: most recent similar keys exempted per token (beta = 1).
    buffer: tokens added between compressions (128).
    redundancy_chunk: keys per block of the similarity matrix (memory vs speed; 256 was fastest on CPU).
    Default budget (no `CompressionConfig.budget`): 1024 tokens per head.
    """

    default_budget = 1024

    window: int = 8
    kernel: int = 7
    lam: float = 0.1
    threshold: float = 0.5
    recent_exempt: int = 1
    buffer: int = 128
    redundancy_chunk: int = 256

    def __post_init__(self) -> None:
        check_window_and_kernel(self.name, "window", self.window, self.kernel)
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"{self.name}: lam={self.lam} must be in [0, 1] (importance weight)")
        if self.threshold < 0:
            raise ValueError(f"{self.name}: threshold={self.threshold} must be >= 0 (key cosine similarity)")
        if self.recent_exempt < 0:
            raise ValueError(f"{self.name}: recent_exempt={self.recent_exempt} must be >= 0")
        check_buffer(self.name, self.buffer)
        if self.redundancy_chunk < 1:
            raise ValueError(f"{self.name}: redundancy_chunk={self.redundancy_chunk} must be >= 1")
        self.window, self.kernel, self.buffer = int(self.window), int(self.kernel), int(self.buffer)
        self.lam, self.threshold = float(self.lam), float(self.threshold)
        self.recent_exempt, self.redundancy_chunk = int(self.recent_exempt), int(self.redundancy_chunk)

    @property
    def observe_queries(self) -> int:
        """The observation window: the cache keeps the last `window` queries."""
        return self.window

    def importance(self, store: PolicyStore) -> torch.Tensor:
        """I: FloatTensor [B, H_c, K], 0 on the observation window and empty slots."""
        return observation_attention(
            store, exclude_window=True, group_pool="max", kernel=self.kernel, key_pool="max"
        )

    def redundancy(self, store: PolicyStore) -> torch.Tensor:
        """R: FloatTensor [B, H_c, K], a softmax over each (row, head)'s valid slots."""
        return key_redundancy(
            store.keys,
            None if store.all_valid else store.valid(),
            self.threshold,
            self.recent_exempt,
            self.redundancy_chunk,
        )

    def scores(self, store: PolicyStore) -> torch.Tensor:
        """`lam * I - (1 - lam) * R`: FloatTensor [B, H_c, K] (higher = keep)."""
        return self.lam * self.importance(store) - (1.0 - self.lam) * self.redundancy(store)
