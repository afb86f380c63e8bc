"""Which layouts have a static form, and the in-place compaction of a budgeted static region.

A `StaticHeadMixedCache` (rlkv/cache/static/cache.py) lays each layer's compressed heads out as
`[early | region]` slots of fixed size. `static_form` decides the region from the policy:

- "streaming": a ring of window + 1 slots (no compaction ever runs; the slot a new token
  overwrites holds the position the dynamic cache evicts at that step);
- "budget" (rkv, snapkv, knorm, sink-recent, h2o, random, rpc, skipkv): budget + `slack` slots, where
  `slack` is how many tokens the policy lets accumulate above the budget before it compresses
  (RPC: its interval P, the region also holding the first P + R). A ratio budget r (RLKV's dynamic
  budget, round(r * real tokens) + sink + window per row) sizes the region for the longest row
  `max_cache_len` allows. The schedule is host-known (`RowSchedule`): the prompt is protected, so
  every row's region receives one generated token per step, and the policy's own rule on host counts
  (a row over budget + slack; RPC: every P tokens) says when a compaction is due and how many tokens
  each row keeps. An int budget needs nothing from the device; a ratio budget needs each row's real
  prompt length, read once at prefill. The policy's own `select` then runs over a
  `CompressedStore` view of the slots and `keep_region` copies the kept region slots, in order, to the region's
  start (a fixed-k stable sort, no data-dependent shape);
- "full": no compressed head in any layer (any policy).

A policy that observes attention (H2O) gets each decode step's probabilities over the slots and keeps
what it accumulates in per-slot buffers of static shape, moved with the slots by the compaction.
An unprotected prompt scored by attention (H2O) gets the prompt's own attention at the prefill, from an
explicit softmax over the slots. RPC without a budget follows its own target (k * P / c + R after its
k-th compaction), sized for the cycles `max_cache_len` allows. SkipKV observes token ids and final
hidden states: the cache hands them over in its host bookkeeping before each forward (rlkv/cache/static/cache.py),
and the policy sizes its sentence state for `max_cache_len` at the prefill (`reserve`). SkipKV with
steering has no static form (it decodes sentences' text on the host): `StaticCacheError` names
`static_cache=False` as the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlkv.cache.settings import CompressionSettings
from rlkv.cache.store import CompressedStore
from rlkv.errors import UserError
from rlkv.policies.base import CompressionPolicy


class StaticCacheError(ValueError, UserError):
    """A layout or request the static cache cannot serve (the message names the fix)."""


# Tokens a budgeted policy lets accumulate above its budget before it compresses (its
# `should_compress` fires when a row holds budget + slack evictable tokens).
BUDGET_SLACK: dict[str, Callable[[CompressionPolicy], int]] = {
    "rkv": lambda policy: max(int(policy.buffer), 1),  # WindowedBufferPolicy.due: >= budget + max(buffer, 1)
    "snapkv": lambda policy: max(int(policy.buffer), 1),
    "knorm": lambda policy: int(policy.buffer) + 1,  # compresses when > budget + buffer
    "sink-recent": lambda policy: 1,  # the base rule: compresses when > budget
    "h2o": lambda policy: 1,  # the base rule; its accumulated attention lives in per-slot buffers
    "random": lambda policy: 1,  # the base rule; priorities hashed from positions, no state
    "skipkv": lambda policy: max(int(policy.buffer), 1),  # R-KV's rule; sentence sums sized at prefill
}

# Policies that cut only the rows over budget + slack (WindowedBufferPolicy.kept_counts: a row whose
# buffer is not full keeps every slot); the others cut every row to its budget when any row is due.
ROWS_DUE = frozenset({"rkv", "snapkv", "skipkv"})


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

    kind: "full" | "streaming" | "budget"; budget: generated tokens a row keeps at most after a
    compaction (an int budget; a ratio budget: its value at max_cache_len real tokens); ratio: the
    ratio r of a ratio budget (0: an int budget), whose row b keeps round(r * (prompt_b + generated))
    + `base` (sink + window); slack: tokens the policy lets accumulate above the budget (RPC: its
    interval); first: RPC's generated tokens at the first compaction (0: not periodic); rows_due:
    only rows over budget + slack are cut; observe: observation queries kept per compressed head;
    protect: the prompt is protected (else its tokens count against the budget and can be evicted,
    from the compaction before the first decode step on); per_cycle: RPC without a budget, whose
    own target after its k-th compaction is k * per_cycle + `base` (its selector window).
    """

    kind: str
    budget: int = 0
    slack: int = 0
    observe: int = 0
    first: int = 0
    ratio: float = 0.0
    base: int = 0
    rows_due: bool = False
    protect: bool = True
    per_cycle: int = 0

    def region_slots(self, window: int) -> int:
        """Slots after the early region: the ring (window + 1) or the budget region (the most it holds)."""
        if self.kind == "streaming":
            return window + 1
        return max(self.first, self.budget + self.slack) if self.kind == "budget" else 0

    def row_budgets(self, real_prompt: list[int], generated: int) -> list[int]:
        """Generated tokens each row may keep once `generated` were written (the dynamic store's budget:
        the prompt is protected, so its evictable tokens are the generated ones)."""
        if not self.ratio:
            return [self.budget] * len(real_prompt)
        return [round(self.ratio * (p + generated)) + self.base for p in real_prompt]


class RowSchedule:
    """The compactions of a budget region as host ints: when one is due and what each row keeps.

    Replays the dynamic cache's decisions from its host counts, so no step reads the device:
    real_prompt: each row's real prompt tokens (needed by a ratio budget or an unprotected prompt;
    zeros otherwise). `due(g)`: a compaction runs once g generated tokens were written (an
    unprotected prompt: from g = 0, before the first decode step); `held(g)`: evictable tokens each
    row holds then, after that compaction if one was due (the generated ones; an unprotected
    prompt's tokens too).
    """

    def __init__(self, form: StaticForm, real_prompt: list[int]) -> None:
        self.form, self.real = form, list(real_prompt)
        self.events: list[tuple[int, list[int]]] = []  # (generated, kept per row) of each compaction
        self.checked = 0 if form.protect else -1  # every generated count up to this one was decided

    def _last(self, generated: int) -> tuple[int, list[int]]:
        """The last compaction at or before `generated` ((0, what the prefill left) before any)."""
        for at, kept in reversed(self.events):
            if at <= generated:
                return at, kept
        return 0, [0] * len(self.real) if self.form.protect else self.real

    def _advance(self, generated: int) -> None:
        form = self.form
        for g in range(self.checked + 1, generated + 1):
            at, kept = self._last(g - 1)
            held = [k + g - at for k in kept]
            if form.first:  # periodic: every `slack` tokens from `first` on, each row cut to its budget
                if g >= form.first and (g - form.first) % form.slack == 0:
                    budgets = form.row_budgets(self.real, g)
                    if form.per_cycle:  # RPC's own target grows by per_cycle every cycle
                        budgets = [(len(self.events) + 1) * form.per_cycle + form.base] * len(held)
                    self.events.append((g, [min(h, b) for h, b in zip(held, budgets, strict=True)]))
                continue
            budgets = form.row_budgets(self.real, g)
            over = [h >= b + form.slack for h, b in zip(held, budgets, strict=True)]
            if any(over):
                cut = over if form.rows_due else [True] * len(held)
                self.events.append(
                    (g, [min(h, b) if c else h for h, b, c in zip(held, budgets, cut, strict=True)])
                )
        self.checked = max(self.checked, generated)

    def due(self, generated: int) -> bool:
        """Whether a compaction runs once `generated` tokens were written."""
        self._advance(generated)
        return bool(self.events) and self._last(generated)[0] == generated

    def held(self, generated: int) -> list[int]:
        """Generated tokens each row's region holds once `generated` were written (and a due compaction ran)."""
        self._advance(generated)
        at, kept = self._last(generated)
        return [k + generated - at for k in kept]

    def last_compaction(self, generated: int) -> tuple[int, list[int]] | None:
        """(generated, kept per row) of the last compaction before `generated`, None before any."""
        self._advance(generated)
        # newest first: a compaction asks for the one just before it (H2O compacts every step)
        return next((event for event in reversed(self.events) if event[0] < generated), None)


def _no_static_form(why: str) -> StaticCacheError:
    return StaticCacheError(
        f"{why}: this layout has no static form. Use the dynamic cache (static_cache=False in "
        "rlkv.inference.generate, static=False in make_cache, --no-static-cache on the command line)"
    )


def static_form(settings: CompressionSettings, has_compressed: bool, max_cache_len: int) -> StaticForm:
    """The static layout of `settings` (policy, budget, sink, window); raises `StaticCacheError` when none."""
    policy = settings.policy
    if not has_compressed:
        return StaticForm("full")
    if getattr(policy, "steering", None) is not None:
        raise _no_static_form(
            f"policy {policy.name!r} with steering (each finished sentence's text is decoded on the host to "
            "count its keywords)"
        )
    if policy.name == "streaming":
        return StaticForm("streaming")
    if policy.name not in BUDGET_SLACK and policy.name not in PERIODIC:
        raise _no_static_form(
            f"policy {policy.name!r} (static forms: streaming, {', '.join(sorted({*BUDGET_SLACK, *PERIODIC}))})"
        )
    budget = settings.budget
    if (budget is None and policy.name not in PERIODIC) or isinstance(budget, bool):
        raise _no_static_form(
            f"policy {policy.name!r} with budget={budget!r} (the static region needs a budget)"
        )
    ratio, base = 0.0, settings.sink + settings.window
    if isinstance(budget, float):  # sized for the longest row: every real token of max_cache_len columns
        ratio, budget = budget, round(budget * max_cache_len) + base
    observe = int(policy.observe_queries)
    if policy.name in PERIODIC:
        first, period = PERIODIC[policy.name](policy)
        per_cycle = 0
        if budget is None:  # its own target, sized for the cycles max_cache_len generated tokens allow
            per_cycle, base = policy.kept_per_cycle, policy.selector_window
            if per_cycle + base < settings.sink + settings.window:
                raise _no_static_form(
                    f"policy {policy.name!r} without a budget, whose first target ({per_cycle} + {base}) is below "
                    f"sink + window ({settings.sink + settings.window}): the forced tokens would exceed it"
                )
            budget = (max(0, max_cache_len - first) // period + 1) * per_cycle + base
        return StaticForm(
            "budget", budget, period, observe, first, ratio, base, False, settings.protect_prompt, per_cycle
        )
    slack = BUDGET_SLACK[policy.name](policy)
    rows_due = policy.name in ROWS_DUE
    return StaticForm("budget", budget, slack, observe, 0, ratio, base, rows_due, settings.protect_prompt)


def dynamic_order(
    row_start: torch.Tensor,
    width: int,
    early: int,
    region: int,
    kept: torch.Tensor | None,
    since: int,
    protect: bool = True,
) -> torch.Tensor:
    """LongTensor[B, width + region]: the static slot that each slot of the dynamic cache's store holds,
    `early + region` (one past the last slot: the caller appends an empty one) where it holds none.

    The policy must see the slots in the dynamic cache's order (its ties break towards the earlier
    slot and its pooling walks the slots in order). The dynamic store holds each row's real prompt
    tokens first (n_b = width - row_start_b of them), then `row_start` empty slots (the padding it
    dropped), then the generated tokens. A compaction packs each row's kept tokens (a protected
    prompt, then the kept_b evictable ones) into max_b(n_b + kept_b) slots (unprotected: max_b
    kept_b), the missing ones empty, and the newer generated tokens follow. Statically the prompt
    sits at slots [early - width, ...) of the early region and the generated tokens in the region;
    a compaction packs the kept evictable tokens from the region's start (unprotected: from slot 0).
    kept: LongTensor[B], evictable tokens each row kept at the last compaction (None: none ran yet);
    since: generated tokens written since then (all of them before any compaction).
    """
    offset, empty = early - width, early + region
    j = torch.arange(width + region, device=row_start.device)[None, :]
    real = (width - row_start)[:, None]
    if kept is None:
        return torch.where(
            j < real,
            offset + j,
            torch.where((j >= width) & (j < width + since), early + j - width, empty),
        )
    kept = kept[:, None]
    prompt, base = (real, early) if protect else (torch.zeros_like(real), 0)
    size = (prompt + kept).amax(0, keepdim=True)
    newer = j - size  # index among the tokens generated since the last compaction
    return torch.where(
        j < prompt,
        offset + j,
        torch.where(
            j < prompt + kept,
            base + j - prompt,
            torch.where((newer >= 0) & (newer < since), base + kept + newer, empty),
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
    state: dict,
    unpadded: bool = False,
) -> CompressedStore:
    """A `CompressedStore` over the slots of a static layer, for the policy's `select`.

    slots: keys, values [B, H_c, N, D] and positions [B, H_c, N] (-1 = empty), in the dynamic cache's
    order (`dynamic_order`); queries: the last N
    observation queries [B, H_c, G, N, D] oldest first and their positions LongTensor[N], or None;
    lengths: (tokens stored, prompt columns); state: the layer's policy state (`store.state`), kept
    between compactions as the dynamic store keeps it (RPC counts its cycles there); unpadded: every
    slot is valid and every row starts at column 0 (`unpadded_run`), so the policy may take its paths
    for a store without empty slots (`select_top_scores`' kept slots), as the dynamic store does.
    """
    view = CompressedStore(layer_idx, head_idx, num_groups, settings)
    view.keys, view.values, view.positions = slots
    if queries is not None:
        view.queries, view.query_positions = queries
    view.row_start = row_start
    view.logical_length, view.prompt_length = lengths
    view.evicted = torch.zeros_like(row_start)
    view.all_valid = unpadded
    if unpadded:
        batch, _, count = view.positions.shape
        view.row_start_host, view.slot_counts, view.uniform = [0] * batch, [count] * batch, True
        if queries is not None:  # the window is the run's last slots: scoring may leave it out by count
            view.view_oldest_query = lengths[0] - queries[1].shape[0]
    view.state = state
    return view


def unpadded_run(
    form: StaticForm,
    early: int,
    width: int,
    generated: int,
    last: tuple[int, list[int]] | None,
    starts: list[int],
) -> tuple[int, int] | None:
    """(lo, hi): when no row is padded (`starts`, each row's first real column, all 0) and rows keep alike,
    the slots the dynamic store holds are the one run [lo, hi), in its order: the prompt at the early
    region's [early - width, early) (an unprotected prompt's only before its first compaction), then the
    kept evictable tokens from the region's base and the newer generated ones. None otherwise.
    last: the previous compaction (generated then, kept per row), None before any."""
    if any(starts):
        return None
    if last is None:
        return early - width, early + generated
    at, kept = last
    if len(set(kept)) != 1:
        return None
    held = kept[0] + generated - at
    return (early - width, early + held) if form.protect else (0, held)


def keep_region(
    view: CompressedStore,
    keep: torch.Tensor,
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    order: torch.Tensor,
    early: int,
    slot_buffers: tuple[tuple[torch.Tensor, float], ...] = (),
) -> None:
    """Keep the region slots the policy's keep mask `keep` ([B, H_c, N] or [B, N] over the view) selects, in
    place: the kept ones, in slot (= position) order, move to the region's start; the rest of the region
    empties.

    view: the slots in the dynamic cache's order, `order` [B, N] their static slot indices
    (`dynamic_order`; one past the last slot for an empty one); slots: the layer's keys, values
    [B, H_c, S, D] and positions [B, H_c, S], written in place; early: slots before the region (never
    compacted: the protected prompt); slot_buffers: the policy's per-slot buffers [B, H_c, S] and
    their fill values, moved likewise (emptied slots get the fill). No host sync.
    """
    if keep.dim() == 2:
        keep = keep[:, None, :].expand_as(view.positions)
    keep = (keep | view.forced_keep()) & view.valid()
    at = order[:, None, :].expand_as(keep)
    batch, heads, num_slots = slots[2].shape
    # one column past the slots: where `order` sends what the dynamic store holds empty
    keep = torch.zeros(batch, heads, num_slots + 1, dtype=torch.bool, device=keep.device).scatter_(
        2, at, keep
    )
    keep = keep[..., early:num_slots]
    # stable sort of the whole region: kept slots first, each group in slot order (static shapes)
    order = torch.sort((~keep).to(torch.uint8), dim=-1, stable=True).indices
    kept = keep.gather(-1, order)
    keys, values, positions = slots
    for buf in (keys, values):
        region = buf[:, :, early:]
        region.copy_(region.gather(2, order[..., None].expand(*order.shape, buf.shape[-1])))
    for buf, fill in ((positions, -1), *slot_buffers):
        region = buf[:, :, early:]
        region.copy_(torch.where(kept, region.gather(2, order), fill))


def keep_in_run(
    view: CompressedStore,
    policy: CompressionPolicy,
    slots: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    lo: int,
    skip: int,
    early: int,
    slot_buffers: tuple[tuple[torch.Tensor, float], ...] = (),
) -> None:
    """`keep_region` for a view of the one run of slots from `lo` (`unpadded_run`): when `policy.select(view)`
    returns the kept slots LongTensor[B, H_c, n] (ascending), all but the first `skip` (the protected
    prompt, which stays where it is) move, in order, to the region's start `early` and the rest of the
    region empties (positions -1, the slot buffers' fill); a keep mask goes through `keep_region`. No host sync."""
    kept = policy.select(view)
    if kept.dtype != torch.long:
        order = torch.arange(lo, lo + view.positions.shape[-1], device=kept.device)
        keep_region(view, kept, slots, order.expand(kept.shape[0], -1), early, slot_buffers)
        return
    moved = kept[..., skip:] + lo if skip else kept + lo
    count = moved.shape[-1]
    for buf in slots[:2]:
        buf[:, :, early : early + count].copy_(
            buf.gather(2, moved[..., None].expand(*moved.shape, buf.shape[-1]))
        )
    for buf, fill in ((slots[2], -1), *slot_buffers):
        buf[:, :, early : early + count].copy_(buf.gather(2, moved))
        buf[:, :, early + count :].fill_(fill)
