"""Random token eviction ("Random Attention", arXiv 2609.03430): keep the prompt, evict uniformly at random.

The cheapest baseline a scored evictor must beat. Each token of a (row, KV head) draws a uniform
random priority when it is stored: a counter-based hash of (seed, layer, KV head, the token's
position within its row), computed on the device from the slots' positions, so it needs no
generator state, never reads the device and traces into a compiled step. A compression keeps the
highest priorities, so the kept evictable tokens are a uniform random sample of everything the head
has seen (reservoir sampling: every token equally likely to stay), drawn independently per head and
per row. The position is counted from the row's first real token, so a row keeps the same tokens
batched (left-padded) or alone. Prompt tokens rank above every generated one (`keep_prompt`): they
stay while the budget holds them, and the budget stays the one every method is matched on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import CompressionPolicy, PolicyStore, select_top_scores, top_scores_counts

_MASK32 = 0xFFFFFFFF
_PROMPT_SCORE = float(1 << 25)  # above every priority (24-bit integers, exact in float32)


def random_priorities(
    seed: int, layer: int, heads: torch.Tensor, rel_positions: torch.Tensor
) -> torch.Tensor:
    """Uniform pseudo-random priorities FloatTensor [B, H_c, K] in [0, 2**24), integers.

    heads: LongTensor [H_c], the KV head indices; rel_positions: [B, H_c, K] positions counted from
    each row's first real token. The same inputs give the same priorities on every device (int64 math
    kept within 32 bits, so no overflow; the finalizer of a 32-bit integer hash)."""
    x = rel_positions.long() * 0x01000193 + heads.long().view(1, -1, 1) * 0x9E3779B1
    x = (x + (layer * 0x85EBCA6B + seed * 0xC2B2AE35)) & _MASK32
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x045D9F3B) & _MASK32
    x = (x >> 16) ^ x
    return (x >> 8).float()


@register_policy("random")
@dataclass(eq=False, kw_only=True)
class RandomEvictionPolicy(CompressionPolicy):
    """Keep the prompt, then a uniform random sample of the other evictable tokens, per KV head.

    seed: the draw (int >= 0); keep_prompt: prompt tokens rank above every generated token.
    Compresses whenever a row holds more evictable tokens than its budget (one eviction per step).
    Default budget (no `CompressionConfig.budget`): 0.2 of the current length + sink + window, as `h2o`.
    """

    default_budget = 0.2

    seed: int = 0
    keep_prompt: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.seed, bool) or int(self.seed) != self.seed or self.seed < 0:
            raise ValueError(f"random: seed={self.seed!r} must be an int >= 0")
        self.seed = int(self.seed)
        self.keep_prompt = bool(self.keep_prompt)

    def scores(self, store: PolicyStore) -> torch.Tensor:
        """FloatTensor [B, H_c, K]: each slot's random priority, prompt slots above all (`keep_prompt`)."""
        rel = store.positions.long()
        if store.row_start is not None:  # None: no row starts late (no padding seen)
            rel = rel - store.row_start.long().view(-1, 1, 1)
        priority = random_priorities(self.seed, store.layer_idx, store.head_idx, rel)
        if self.keep_prompt:
            in_prompt = (store.positions >= 0) & (store.positions < store.prompt_length)
            priority = priority.masked_fill(in_prompt, _PROMPT_SCORE)
        return priority

    def kept_counts(self, store: PolicyStore) -> list[int]:
        return top_scores_counts(store)

    def select(self, store: PolicyStore) -> torch.Tensor:
        return select_top_scores(store, self.scores(store))
