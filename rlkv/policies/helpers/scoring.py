"""Scoring helpers shared by the attention-based policies (R-KV, SkipKV, SnapKV, RPC, H2O).

Shapes follow `rlkv/policies/base.py`: B batch rows, H compressed KV heads, G query heads per KV
head (GQA), N observation queries, K store slots, D head dim. Masked entries are excluded, never
zero-filled before a softmax: a slot that is padding, empty, in the future of a query or (where a
method says so) inside the observation window gets no probability mass and no pooling weight.

Typical use (R-KV's importance):

    logits = observation_logits(store, exclude_window=True)        # [B, H, G, N, K], -inf masked
    probs = masked_softmax(pool_query_groups(logits, "max"))        # [B, H, N, K]
    pooled = pool_along_keys(probs, 7, "max", store.valid())        # [B, H, N, K]
    importance = mean_over_queries(pooled, store.query_valid())     # [B, H, K]
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

from rlkv.policies.base import (
    CompressionPolicy,
    PolicyStore,
    keep_top_scores,
    select_top_scores,
    top_scores_counts,
)

NEG_INF = float("-inf")


def check_window_and_kernel(policy: str, window_name: str, window: int, kernel: int) -> None:
    """One clear ValueError, naming `policy` and the field, for a query window < 1 or a pooling
    kernel that is not a positive odd number (the settings every observation-window policy has)."""
    if window < 1:
        raise ValueError(f"{policy}: {window_name}={window} must be >= 1 (observation queries)")
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"{policy}: kernel={kernel} must be a positive odd number (pooling window)")


def check_buffer(policy: str, buffer: int) -> None:
    """One clear ValueError, naming `policy`, for a negative compression buffer."""
    if buffer < 0:
        raise ValueError(f"{policy}: buffer={buffer} must be >= 0 (tokens added between compressions)")


def raw_logits(queries: torch.Tensor, keys: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """Scaled dot products of grouped queries with keys, in float32.

    queries: [B, H, G, N, D]; keys: [B, H, K, D]; scaling defaults to 1/sqrt(D).
    Returns FloatTensor [B, H, G, N, K] (unmasked).
    """
    if scaling is None:
        scaling = 1.0 / math.sqrt(queries.shape[-1])
    groups = queries.shape[2]
    # one batched matmul over the G x N queries (an einsum permutes and copies around it); the scale
    # goes on the queries, the smaller side
    scaled = queries.float().flatten(2, 3) * scaling  # [B, H, G * N, D]
    return (scaled @ keys.float().transpose(-1, -2)).unflatten(2, (groups, -1))


def observation_key_mask(
    key_positions: torch.Tensor,
    key_valid: torch.Tensor,
    query_positions: torch.Tensor,
    query_valid: torch.Tensor,
    exclude_window: bool = False,
) -> torch.Tensor:
    """Which (query, key) pairs may carry attention: BoolTensor [B, H, N, K].

    key_positions: LongTensor [B, H, K] (logical positions, -1 for empty slots); key_valid:
    BoolTensor [B, H, K]; query_positions: LongTensor [N]; query_valid: BoolTensor [B, N].
    A pair is allowed when both are real tokens and the key is not after the query (causal).
    `exclude_window` also drops keys inside the observation window (positions >= the oldest
    observation query), as R-KV and SnapKV do before their softmax.
    """
    qpos = query_positions.to(key_positions.device)
    if exclude_window and qpos.numel() > 0:
        # a key before the oldest observation query is before every one of them: causal already
        keys = (key_valid & (key_positions < qpos.min()))[:, :, None, :]
    else:
        keys = key_valid[:, :, None, :] & (key_positions[:, :, None, :] <= qpos[None, None, :, None])
    return keys & query_valid[:, None, :, None].to(keys.device)


def observation_logits(
    store: PolicyStore, exclude_window: bool = False, scaling: float | None = None
) -> torch.Tensor:
    """Logits of the store's cached observation queries against its keys: [B, H, G, N, K].

    Disallowed pairs (see `observation_key_mask`) are -inf. Needs `observe_queries > 0`. With
    `exclude_window` on a store whose window is its last slots (`observation_prefix` is an int P),
    only the first P keys are scored: [B, H, G, N, P], every pair allowed (no mask to build);
    `pooled_importance` takes either form.
    """
    queries = store.queries  # put in order when read (rlkv/cache/store.py): read it once
    if queries is None:
        raise ValueError("observation_logits needs cached queries: set the policy's observe_queries > 0")
    prefix = observation_prefix(store) if exclude_window else None
    if prefix is not None:  # the allowed keys are exactly the first `prefix` slots: score only those
        return raw_logits(queries, store.keys[:, :, :prefix], scaling)
    logits = raw_logits(queries, store.keys, scaling)
    start = window_start(store) if exclude_window and real_queries(store) is None else None
    if start is not None:  # no empty slot, no padded row: the allowed keys are those before the window
        return logits.masked_fill((store.positions >= start)[:, :, None, None, :], NEG_INF)
    allowed = observation_key_mask(
        store.positions, store.valid(), store.query_positions, store.query_valid(), exclude_window
    )
    return logits.masked_fill(~allowed[:, :, None], NEG_INF)


def pool_query_groups(logits: torch.Tensor, mode: Literal["max", "mean"] = "max") -> torch.Tensor:
    """Pool the G query heads of each KV head: [B, H, G, N, K] -> [B, H, N, K].

    R-KV's convention is the max of the raw logits over the group, taken before the softmax.
    Masked (-inf) entries stay -inf under both modes: masks never differ inside a group.
    """
    if mode == "max":
        return logits.amax(dim=2)
    if mode == "mean":
        return logits.mean(dim=2)
    raise ValueError(f"pool_query_groups mode={mode!r}: use 'max' or 'mean'")


def masked_softmax(logits: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim` over the finite entries; -inf entries get 0, an all -inf line gives all 0."""
    # torch's softmax gives -inf entries exactly 0 and an all -inf line NaN, which becomes 0
    return torch.softmax(logits.float(), dim=dim).nan_to_num(0.0)


def _compaction_order(valid: torch.Tensor) -> torch.Tensor:
    """Slot indices [..., K] that list the valid slots first (in slot order), then the empty ones."""
    return torch.sort((~valid).to(torch.int8), dim=-1, stable=True).indices


def pool_along_keys(
    scores: torch.Tensor,
    kernel: int,
    mode: Literal["max", "avg"],
    valid: torch.Tensor | None,
    count_include_pad: bool = True,
    valid_prefix: bool = False,
) -> torch.Tensor:
    """1-D pooling along the key (last) axis, same length, centred window of `kernel` slots.

    scores: [B, H, N, K] or [B, H, K]; valid: BoolTensor [B, H, K] (which slots hold real tokens).
    Neighbours are the adjacent *valid* slots in position order (empty and padding slots are
    skipped, so a row pools the same way alone or inside a left-padded batch), like
    `F.max_pool1d` / `F.avg_pool1d` with `padding=kernel // 2` over the retained tokens only.
    `max` ignores positions beyond the ends; `avg` divides by `kernel` when `count_include_pad`
    (torch's default, RPC's code) else by the number of real tokens in the window. Empty slots
    come back as 0. `kernel` must be odd. `valid_prefix`: the caller knows the valid slots of every
    line come first (a store with no empty slot, minus its newest observation window), so they are
    pooled in place, without sorting them to the front and back. `valid=None`: every slot is valid
    (torch's pooling as it is, no mask built).
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel={kernel}: must be a positive odd number")
    if mode not in ("max", "avg"):
        raise ValueError(f"pool_along_keys mode={mode!r}: use 'max' or 'avg'")
    half = kernel // 2
    if valid is None:
        flat = scores.float().reshape(-1, 1, scores.shape[-1])
        if mode == "max":
            return F.max_pool1d(flat, kernel, stride=1, padding=half).reshape(scores.shape)
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=half, count_include_pad=count_include_pad)
        return pooled.reshape(scores.shape)
    if kernel == 1:
        return scores.masked_fill(~_broadcast_valid(valid, scores), 0.0)
    lead = scores.shape[:-1]
    valid_b = _broadcast_valid(valid, scores)
    if valid_prefix:
        order, compact, compact_valid = None, scores.float(), valid_b
    else:
        order = _compaction_order(valid_b)
        compact = scores.float().gather(-1, order)
        compact_valid = valid_b.gather(-1, order)
    flat = compact.reshape(-1, 1, scores.shape[-1])
    flat_valid = compact_valid.reshape(-1, 1, scores.shape[-1])
    if mode == "max":
        pooled = F.max_pool1d(flat.masked_fill(~flat_valid, NEG_INF), kernel, stride=1, padding=half)
    else:
        summed = F.avg_pool1d(flat.masked_fill(~flat_valid, 0.0), kernel, stride=1, padding=half) * kernel
        if count_include_pad:
            pooled = summed / kernel
        else:
            count = F.avg_pool1d(flat_valid.float(), kernel, stride=1, padding=half) * kernel
            pooled = summed / count.clamp(min=1.0)
    pooled = pooled.reshape(*lead, -1).masked_fill(~compact_valid, 0.0)
    return pooled if order is None else torch.empty_like(pooled).scatter_(-1, order, pooled)


def _broadcast_valid(valid: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """Key validity [B, H, K] expanded to the shape of `scores` ([B, H, K] or [B, H, N, K])."""
    if scores.dim() == valid.dim() + 1:
        valid = valid[:, :, None, :]
    return valid.expand(scores.shape)


def mean_over_queries(scores: torch.Tensor, query_valid: torch.Tensor | None) -> torch.Tensor:
    """Mean over the real observation queries: [B, H, N, K] -> [B, H, K]; query_valid BoolTensor [B, N]
    (None: every query is real, see `real_queries`)."""
    if query_valid is None:
        return scores.float().mean(dim=2)
    weight = query_valid.to(scores.device, torch.float32)[:, None, :, None]
    count = weight.sum(dim=2).clamp(min=1.0)
    return (scores.float() * weight).sum(dim=2) / count


def real_queries(store: PolicyStore) -> torch.Tensor | None:
    """`store.query_valid()`, or None when the host knows every row starts at column 0 (no padding:
    every observation query is real)."""
    starts = store.row_start_host
    return None if starts is not None and not any(starts) else store.query_valid()


def window_start(store: PolicyStore) -> int | None:
    """Host int: the oldest observation query's position when the store has no empty slot (so the
    observation window's slots are exactly those at or past it, and every other slot is valid), else
    None (build the masks). Read from host counts: no tensor op."""
    return store.oldest_query_position if store.all_valid else None


WINDOW_CUT = "observation_window_cut"  # store.state key: a compression kept only part of the window


def observation_prefix(store: PolicyStore) -> int | None:
    """Host int P: the slots before the observation window, when the window is the last slots of
    every (row, head): no empty slot (slots ascend in position), every window token still stored (no
    compression had a budget under the window, `note_window_cut`) and every observation query real
    (no padded row); else None. Read from host values."""
    start = window_start(store)
    if start is None or store.state.get(WINDOW_CUT) or real_queries(store) is not None:
        return None
    prefix = store.keys.shape[2] - (store.logical_length - start)
    return prefix if prefix > 0 else None  # no slot before the window: nothing to score, the masks decide


def note_window_cut(store: PolicyStore, due: list[bool]) -> None:
    """Before a compression: remember (host flag in `store.state`) when a due row's budget beyond its
    forced set is under the observation window, so that the window may lose tokens and
    `observation_prefix` no longer holds for this sequence."""
    oldest = store.oldest_query_position
    if oldest is None or store.state.get(WINDOW_CUT) or not any(due):
        return
    window = store.logical_length - oldest
    kept, forced = top_scores_counts(store), store.forced_counts()
    if any(d and k - f < window for d, k, f in zip(due, kept, forced, strict=True)):
        store.state[WINDOW_CUT] = True


def observation_attention(
    store: PolicyStore,
    exclude_window: bool = True,
    group_pool: Literal["max", "mean"] = "max",
    kernel: int = 1,
    key_pool: Literal["max", "avg"] = "max",
) -> torch.Tensor:
    """Attention importance of each slot from the cached observation queries: FloatTensor [B, H, K].

    Logits pooled over the GQA group (`group_pool`), softmax over the allowed keys, pooled along
    the key axis per query (`kernel`, `key_pool`), then averaged over the real observation queries.
    Slots outside the softmax (padding, empty, observation window when excluded) score 0.
    """
    logits = observation_logits(store, exclude_window=exclude_window)
    probs = masked_softmax(pool_query_groups(logits, group_pool))
    return pooled_importance(store, probs, kernel, key_pool, exclude_window)


def pooled_importance(
    store: PolicyStore,
    probs: torch.Tensor,
    kernel: int,
    key_pool: Literal["max", "avg"],
    exclude_window: bool = True,
) -> torch.Tensor:
    """Observation probabilities [B, H, N, K] pooled along the keys (`kernel`, `key_pool`) over the
    valid slots (outside the observation window when excluded), then averaged over the real
    observation queries: FloatTensor [B, H, K]. The masks the host knows are all True are skipped.
    probs may cover only the first `observation_prefix(store)` slots (`observation_logits`' trimmed
    form): they are pooled as they are and the window's slots score 0."""
    prefix = observation_prefix(store) if exclude_window else None
    if prefix is not None and probs.shape[-1] == prefix:
        if kernel > 1:  # every slot is in the domain: torch's pooling, its padding the domain's ends
            probs = pool_along_keys(probs, kernel, key_pool, None)
        importance = mean_over_queries(probs, None)
        return F.pad(importance, (0, store.keys.shape[2] - prefix))
    if kernel > 1:
        start = window_start(store) if exclude_window else None
        if start is not None:  # no empty slot: the domain is the slots before the window
            domain = store.positions < start
        else:
            domain = store.valid() & ~observation_window(store) if exclude_window else store.valid()
        probs = pool_along_keys(probs, kernel, key_pool, domain, valid_prefix=store.all_valid)
    return mean_over_queries(probs, real_queries(store))


def observation_window(store: PolicyStore) -> torch.Tensor:
    """BoolTensor [B, H, K]: valid slots whose position is one of the cached observation queries'."""
    start = window_start(store)
    if start is not None:
        return store.positions >= start
    query_positions = store.query_positions  # built when read (rlkv/cache/store.py): read it once
    if query_positions is None or query_positions.numel() == 0:
        return torch.zeros_like(store.valid())
    return store.valid() & (store.positions >= query_positions.min())


class WindowedBufferPolicy(CompressionPolicy):
    """R-KV / SnapKV schedule: a (row, KV head) compresses once it holds budget + `buffer` evictable
    tokens; it then keeps its observation window plus the top `scores(store)` up to the budget.
    Rows and heads whose buffer is not full keep everything, as they would running alone.
    Subclasses set `buffer` and implement `scores(store) -> FloatTensor [B, H_c, K]`.
    """

    buffer: int = 128

    def due(self, store: PolicyStore) -> torch.Tensor:
        """BoolTensor [B, H_c]: (row, head) pairs whose buffer is full (budget + buffer evictable tokens)."""
        return store.num_evictable() >= store.budget[:, None] + max(self.buffer, 1)

    def due_rows(self, store: PolicyStore) -> list[bool]:
        """`due` per row, from host counts (every head of a row holds the same count)."""
        budget = store.budget_counts()
        if budget is None:
            return [False] * len(store.slot_counts)
        need = max(self.buffer, 1)
        return [n >= b + need for n, b in zip(store.evictable_counts(), budget, strict=True)]

    def should_compress(self, store: PolicyStore) -> bool:
        return any(self.due_rows(store))

    def kept_counts(self, store: PolicyStore) -> list[int]:
        """Rows whose buffer is full keep `keep_top_scores`' count; the others keep every slot."""
        top = top_scores_counts(store)
        return [
            k if due else n for k, n, due in zip(top, store.slot_counts, self.due_rows(store), strict=True)
        ]

    def scores(self, store: PolicyStore) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement scores(store)")

    def select(self, store: PolicyStore) -> torch.Tensor:
        # host counts exist except on the static cache's view, whose row starts only the device knows
        due = self.due_rows(store) if store.row_start_host is not None else None
        if due is not None:
            note_window_cut(store, due)
        every_row = due is not None and all(due)  # every (row, head) compresses: no mask to mix
        prefix = observation_prefix(store) if every_row else None
        if prefix is not None:  # the observation window is the newest slots: kept by count
            return select_top_scores(store, self.scores(store), newest=store.keys.shape[2] - prefix)
        scores = self.scores(store).masked_fill(observation_window(store), math.inf)
        if every_row:
            return select_top_scores(store, scores)
        keep = keep_top_scores(store, scores)
        return torch.where(self.due(store)[..., None], keep, store.valid())
