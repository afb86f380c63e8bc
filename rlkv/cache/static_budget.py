"""Which layouts have a static form, and the in-place compaction of a budgeted static region.

A `StaticHeadMixedCache` (rlkv/cache/static.py) lays each layer's compressed heads out as
`[early | region]` slots of fixed size. `static_form` decides the region from the policy:

- "streaming": a ring of window + 1 slots (no compaction ever runs; the slot a new token
  overwrites holds the position the dynamic cache evicts at that step);
- "budget" (rkv, snapkv, knorm, sink-recent, rpc with an int budget): budget + `slack` slots, where
  `slack` is how many tokens the policy lets accumulate above the budget before it compresses
  (RPC: its interval P, the region also holding the first P + R). The schedule is host-known: every
  (row, head) holds the same number of generated tokens (the prompt is protected), so a compression
  is due after exactly `first` generated tokens (budget + slack; RPC: P + R), then every `slack`.
  `compact_region` then runs the policy's own `select` over a
  `CompressedStore` view of the slots and copies the (at most `budget`) kept region slots, in order, to
  the region's start (a fixed-k stable sort, no data-dependent shape);
- "full": no compressed head in any layer (any policy).

A policy that observes attention (H2O) gets each decode step's probabilities over the slots and keeps
what it accumulates in per-slot buffers of static shape, moved with the slots by the compaction.
Everything else (observers of tokens / hidden states, float budgets,
SkipKV, RPC without a budget, an unprotected prompt with a budget) has no static form: `StaticCacheError` names
`static_cache=False` as the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkv.cache.store import CompressedStore, CompressionSettings
from rlkv.errors import UserError
from rlkv.policies.base import CompressionPolicy


class StaticCacheError(ValueError, UserError):
    """A layout or request the static cache cannot serve (the message names the fix)."""


# Tokens a budgeted policy lets accumulate above its budget before it compresses (its
# `should_compress` fires when the region holds budget + slack evictable tokens).
BUDGET_SLACK: dict[str, Callable[[CompressionPolicy], int]] = {
    "rkv": lambda policy: max(int(policy.buffer), 1),  # WindowedBufferPolicy.due: >= budget + max(buffer, 1)
    "snapkv": lambda policy: max(int(policy.buffer), 1),
    "knorm": lambda policy: int(policy.buffer) + 1,  # compresses when > budget + buffer
    "sink-recent": lambda policy: 1,  # the base rule: compresses when > budget
    "h2o": lambda policy: 1,  # the base rule; its accumulated attention lives in per-slot buffers
}


# Policies that compress on a schedule of generated tokens, whatever the region holds: (generated tokens
# at the first compaction, tokens between compactions).
PERIODIC: dict[str, Callable[[CompressionPolicy], tuple[int, int]]] = {
    "rpc": lambda policy: (
        policy.interval + policy.selector_window,
        policy.interval,
    ),  # RPCPolicy.should_compress
}


@dataclass(frozen=True)
class StaticForm:
    """How the compressed heads of every layer are laid out (see the module docstring).

    kind: "full" | "streaming" | "budget"; budget: generated tokens kept per compressed head after a
    compaction; first: generated tokens held when the first compaction is due (budget + slack for the
    budgeted policies; RPC: interval + selector window); slack: generated tokens between later
    compactions; observe: observation queries kept per compressed head (the policy's `observe_queries`).
    """

    kind: str
    budget: int = 0
    slack: int = 0
    observe: int = 0
    first: int = 0

    def region_slots(self, window: int) -> int:
        """Slots after the early region: the ring (window + 1) or the budget region (the most it holds)."""
        if self.kind == "streaming":
            return window + 1
        return max(self.first, self.budget + self.slack) if self.kind == "budget" else 0

    def compaction_due(self, generated: int) -> bool:
        """Whether the region is full before the forward of generated token `generated` (0-based)."""
        if self.kind != "budget" or generated < self.first:
            return False
        return (generated - self.first) % self.slack == 0

    def held(self, generated: int) -> int:
        """Generated tokens the region holds once `generated` were written and a compaction due then ran
        (host ints: compaction k keeps min(budget, what the region holds), then `slack` more arrive)."""
        if self.kind != "budget" or generated < self.first:
            return generated
        kept, at = min(self.budget, self.first), self.first
        while kept < self.budget and generated >= at + self.slack:  # kept grows to the budget, then stays
            kept, at = min(self.budget, kept + self.slack), at + self.slack
        return kept + (generated - at) % self.slack if kept == self.budget else kept + generated - at


def _no_static_form(why: str) -> StaticCacheError:
    return StaticCacheError(
        f"{why}: this layout has no static form. Use the dynamic cache (static_cache=False in "
        "rlkv.inference.generate, static=False in make_cache, --no-static-cache on the command line)"
    )


def static_form(settings: CompressionSettings, has_compressed: bool) -> StaticForm:
    """The static layout of `settings` (policy, budget, sink, window); raises `StaticCacheError` when none."""
    policy = settings.policy
    if not has_compressed:
        return StaticForm("full")
    if policy.observe_tokens or policy.observe_hidden_states:
        raise _no_static_form(f"policy {policy.name!r} observes tokens or hidden states")
    if policy.name == "streaming":
        return StaticForm("streaming")
    if policy.name not in BUDGET_SLACK and policy.name not in PERIODIC:
        raise _no_static_form(
            f"policy {policy.name!r} (static forms: streaming, {', '.join(sorted({*BUDGET_SLACK, *PERIODIC}))})"
        )
    budget = settings.budget
    if not isinstance(budget, int) or isinstance(budget, bool):
        raise _no_static_form(
            f"policy {policy.name!r} with budget={budget!r} (the static region needs an int budget"
            + ("; RPC's own target grows every cycle" if budget is None and policy.name in PERIODIC else "")
            + ")"
        )
    if not settings.protect_prompt:
        raise _no_static_form(
            f"policy {policy.name!r} with protect_prompt=False (the compression schedule then depends "
            "on each row's prompt length)"
        )
    if policy.name in PERIODIC:
        first, period = PERIODIC[policy.name](policy)
        return StaticForm("budget", budget, period, int(policy.observe_queries), first)
    slack = BUDGET_SLACK[policy.name](policy)
    return StaticForm("budget", budget, slack, int(policy.observe_queries), budget + slack)


def dynamic_order(
    row_start: torch.Tensor, width: int, early: int, region: int, budget: int, compacted: bool
) -> torch.Tensor:
    """LongTensor[B, width + region]: the static slot that each slot of the dynamic cache's store holds.

    The policy must see the slots in the dynamic cache's order (its ties break towards the earlier
    slot and its pooling walks the slots in order). The dynamic store holds each row's real prompt
    tokens first (n = width - row_start of them), then `row_start` empty slots (the padding it
    dropped), then the generated tokens; after its first compaction it packs the kept tokens, so
    the empty slots sit between the kept and the newer generated ones. Statically the prompt sits
    at slots [early - width, ...) of the early region, the generated tokens in the region.
    """
    offset = early - width
    j = torch.arange(width + region, device=row_start.device)
    if not compacted:  # prompt, padding gap, generated: the static order minus the unused early slots
        return torch.where(j < width, offset + j, early + j - width).expand(row_start.shape[0], -1)
    real = (width - row_start)[:, None]
    j = j[None, :]
    kept, gap = j - real, j - real - budget  # offsets inside the kept run and the padding gap
    return torch.where(
        j < real,
        offset + j,
        torch.where(
            kept < budget,
            early + kept,
            torch.where(j < width + budget, offset + real + gap, early + j - width),
        ),
    )


def policy_view(
    layer_idx: int,
    head_idx: torch.Tensor,
    num_groups: int,
    settings: CompressionSettings,
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    queries: tuple[torch.Tensor, torch.Tensor] | None,
    row_start: torch.Tensor,
    lengths: tuple[int, int],
) -> CompressedStore:
    """A `CompressedStore` over the slots of a static layer, for the policy's `select`.

    slots: keys, values [B, H_c, N, D] and positions [B, H_c, N] (-1 = empty), in the dynamic cache's
    order (`dynamic_order`); queries: the last N
    observation queries [B, H_c, G, N, D] oldest first and their positions LongTensor[N], or None;
    lengths: (tokens stored, prompt columns).
    """
    view = CompressedStore(layer_idx, head_idx, num_groups, settings)
    view.keys, view.values, view.positions = slots
    if queries is not None:
        view.queries, view.query_positions = queries
    view.row_start = row_start
    view.logical_length, view.prompt_length = lengths
    view.evicted = torch.zeros_like(row_start)
    view.all_valid = False
    return view


def compact_region(
    view: CompressedStore,
    policy: CompressionPolicy,
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    order: torch.Tensor,
    early: int,
    budget: int,
    slot_buffers: tuple[tuple[torch.Tensor, float], ...] = (),
) -> None:
    """Run `policy.select(view)` and keep the selected region slots in place: the first `budget` kept
    ones, in slot (= position) order, move to the region's start; the rest of the region empties.

    view: the slots in the dynamic cache's order, `order` [B, N] their static slot indices
    (`dynamic_order`); slots: the layer's keys, values [B, H_c, S, D] and positions [B, H_c, S],
    written in place; early: slots before the region (never compacted: the protected prompt);
    slot_buffers: the policy's per-slot buffers [B, H_c, S] and their fill values, moved likewise
    (emptied slots get the fill). No host sync.
    """
    keep = policy.select(view)
    if keep.dim() == 2:
        keep = keep[:, None, :].expand_as(view.positions)
    keep = (keep | view.forced_keep()) & view.valid()
    at = order[:, None, :].expand_as(keep)
    keep = torch.zeros_like(slots[2], dtype=torch.bool).scatter_(2, at, keep)[..., early:]
    # stable sort: kept slots first, each group in slot order; a fixed k keeps the shapes static
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices[..., :budget]
    kept = keep.gather(-1, order)
    keys, values, positions = slots
    for buf in (keys, values):
        region = buf[:, :, early:]
        taken = region.gather(2, order[..., None].expand(*order.shape, buf.shape[-1]))
        region[:, :, :budget].copy_(taken)
    for buf, fill in ((positions, -1), *slot_buffers):
        region = buf[:, :, early:]
        taken = torch.where(kept, region.gather(2, order), fill)
        region[:, :, :budget].copy_(taken)
        region[:, :, budget:].fill_(fill)
