"""Searches over which KV heads keep a full cache, scored by the joint teacher-forced NLL of a head set.

A ranking (ablation, learned gates) scores heads one at a time; a sparsity uses the set it keeps full, jointly,
and heads interact. Both searches here score whole layouts: the `completion_nll` of the model's own greedy
solutions (nats per completion token) with the layout's compressed heads at sink + local attention, as an
increase over full KV (`LayoutScorer`, memoised so a stopped search resumes).

- `refine_cut` (`rlkv refine-mask`): from a mask's cut at each sparsity, swaps of its weakest full heads with
  the strongest compressed ones.
- `eliminate` (`rlkv search-mask`, "search (no RL)"): block-greedy backward elimination from a near-lossless
  set (e.g. the ablation mask's s=0.5 heads): each round re-scores removing each remaining full head (or, with
  `shards`, each layer's next group of `shards` heads) from the current set and removes the `block` cheapest;
  the removal order is one nested ranking that serves every sparsity between the start and the stop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rlkv.ablation import completion_nll
from rlkv.data.batches import Solution
from rlkv.head_mask import HeadMask


class LayoutScorer:
    """NLL increase over full KV (nats/token) of head layouts, on `sequences`, with the model's RLKV gates.

    A layout is its full heads as flat indices (layer * H_kv + head); every NLL is memoised in `scored` (key
    "base" for full KV, else the sorted indices joined by commas) and `on_score(scored)` runs after each new
    one, so a long search can save them and resume. `evaluated` collects the keys asked for since last reset.
    """

    def __init__(
        self,
        model: Any,
        gates: Any,
        sequences: list[Solution],
        batch_size: int,
        scored: dict[str, float] | None = None,
        on_score: Callable[[dict[str, float]], None] | None = None,
    ):
        self.model, self.gates, self.sequences, self.batch_size = model, gates, sequences, batch_size
        self.scored = {} if scored is None else scored
        self.on_score = on_score
        self.num_heads = gates.alpha.numel()
        self.evaluated: set[str] = set()
        self.base = self._nll("base", list(range(self.num_heads)))

    def _nll(self, key: str, full: list[int]) -> float:
        if key not in self.scored:
            alpha = torch.zeros(self.num_heads)
            alpha[full] = 1.0
            with torch.no_grad():
                self.gates.alpha.copy_(alpha.view_as(self.gates.alpha))
            self.scored[key] = completion_nll(self.model, self.sequences, self.batch_size)
            if self.on_score is not None:
                self.on_score(self.scored)
        return self.scored[key]

    def increase(self, full: list[int]) -> float:
        """NLL increase over full KV with exactly `full` (flat indices) kept full."""
        key = ",".join(map(str, sorted(full)))
        self.evaluated.add(key)
        return self._nll(key, full) - self.base


def _ranked_mask(ranking: list[int], mask: HeadMask, model: Any, key: str, record: dict) -> HeadMask:
    """`mask`'s metadata (its own `key` record replaced by `record`) on the ranking `ranking` (flat indices, most
    important first), whose first k heads are the full ones when k heads stay full."""
    h = mask.num_kv_heads
    order = torch.tensor([[i // h, i % h] for i in reversed(ranking)])
    ranked = HeadMask.from_order(
        order, model, **{k: v for k, v in mask.metadata.items() if k != key}, **{key: record}
    )
    ranked.train_sink, ranked.train_local = mask.train_sink, mask.train_local
    return ranked


def _ranking(mask: HeadMask) -> list[int]:
    """`mask`'s heads as flat indices, most important first."""
    return [layer * mask.num_kv_heads + head for layer, head in mask.order().flip(0).tolist()]


@dataclass
class CutSearch:
    """What `refine_cut` did at one sparsity: the full heads it started from and kept (flat indices
    layer * H_kv + head), their NLL increases over full KV (nats/token), the swaps it accepted
    ((out, in, increase after)), and how many layouts it scored."""

    sparsity: float
    start: list[int]
    kept: list[int]
    start_increase: float
    increase: float
    swaps: list[tuple[int, int, float]]
    evaluated: int


def refine_cut(
    model: Any,
    sequences: list[Solution],
    mask: HeadMask,
    sparsities: list[float],
    *,
    sink: int = 16,
    local: int = 64,
    swap_in: int = 4,
    swap_out: int = 6,
    rounds: int = 3,
    batch_size: int = 4,
    progress: bool = True,
    scored: dict[str, float] | None = None,
    on_score: Callable[[dict[str, float]], None] | None = None,
) -> tuple[HeadMask, list[CutSearch]]:
    """Refine `mask`'s cut at each sparsity by a greedy swap search on the joint NLL of `sequences`.

    From the fewest compressed heads on, each sparsity starts from the mask's top heads (within the set the
    previous sparsity kept, so the sets nest and one ranking serves all), and each round scores every
    swap of one of its `swap_in` lowest-ranked full heads with one of the `swap_out` highest-ranked
    others (`completion_nll` with those heads at sink + local) and takes the best if it lowers the NLL;
    `rounds` rounds at most. Returns the refined mask (its `full_heads(s)` is the kept set at each
    searched s, the mask's order elsewhere; `metadata["cut_search"]` records the search) and the searches.
    `scored` / `on_score`: `LayoutScorer`'s memo and callback (a long search saves and resumes from them).
    """
    from tqdm.auto import tqdm

    from rlkv.ablation import gated_model

    mask.check_compatible(model)
    if swap_in < 1 or swap_out < 1 or rounds < 0:
        raise ValueError(
            f"refine_cut needs swap_in, swap_out >= 1 and rounds >= 0, got {swap_in}, {swap_out}, {rounds}"
        )
    targets = sorted(set(sparsities))
    searches: list[CutSearch] = []
    with gated_model(model, sink, local) as gates:
        score = LayoutScorer(model, gates, sequences, batch_size, scored, on_score)
        pool = _ranking(mask)  # the heads ranked for this sparsity
        allowed = set(pool)  # those it may keep
        bar = tqdm(total=len(targets), desc="cut search", disable=not progress, dynamic_ncols=True)
        for s in targets:
            start = pool[: mask.num_full_heads(s)]
            kept, swaps = list(start), []
            score.evaluated = set()
            best = score.increase(kept)
            for _ in range(rounds):
                weakest = [h for h in pool if h in kept][-swap_in:] if kept else []
                strongest = [h for h in pool if h in allowed and h not in kept][:swap_out]
                tried = [
                    (score.increase([h for h in kept if h != out] + [new]), out, new)
                    for out in weakest
                    for new in strongest
                ]
                if not tried or min(tried)[0] >= best:
                    break
                best, out, new = min(tried)
                kept = [h for h in kept if h != out] + [new]
                swaps.append((out, new, best))
                bar.set_postfix_str(f"s={s:g} +{best:.4f} nats/token", refresh=True)
            start_increase = score.increase(start)
            searches.append(
                CutSearch(s, start, sorted(kept), start_increase, best, swaps, len(score.evaluated))
            )
            # the next (higher) sparsity ranks within this kept set, so the sets nest
            pool, allowed = [h for h in pool if h in kept] + [h for h in pool if h not in kept], set(kept)
            bar.update(1)
        bar.close()
    record = {"base_nll": score.base, "sink": sink, "local": local, "searches": [vars(c) for c in searches]}
    return _ranked_mask(pool, mask, model, "cut_search", record), searches


@dataclass
class EliminationRound:
    """One round of `eliminate`: the heads it compressed (flat indices, in the order they go: cheapest first),
    each one's NLL increase when removed alone from the round's set, the full heads left (sorted), that set's
    NLL increase over full KV (nats/token), and the layouts the round scored."""

    removed: list[int]
    removal_increases: list[float]
    full: list[int]
    increase: float
    evaluated: int


def _units(full: list[int], ranking: list[int], num_kv_heads: int, shards: int) -> list[list[int]]:
    """The removable units of a full set: each head (shards 1), or per layer with at least `shards` full heads
    its `shards` lowest-ranked ones, so every layer keeps a multiple of `shards` full heads."""
    if shards == 1:
        return [[h] for h in full]
    position = {h: i for i, h in enumerate(ranking)}
    layers: dict[int, list[int]] = {}
    for h in sorted(full, key=position.__getitem__):
        layers.setdefault(h // num_kv_heads, []).append(h)
    return [heads[-shards:] for heads in layers.values() if len(heads) >= shards]


def eliminate(
    model: Any,
    sequences: list[Solution],
    mask: HeadMask,
    *,
    start: float = 0.5,
    stop: float = 0.875,
    block: int = 2,
    shards: int = 1,
    sink: int = 16,
    local: int = 64,
    batch_size: int = 4,
    progress: bool = True,
    scored: dict[str, float] | None = None,
    on_score: Callable[[dict[str, float]], None] | None = None,
) -> tuple[HeadMask, list[EliminationRound]]:
    """Block-greedy backward elimination on the joint NLL of `sequences`: one nested ranking for every sparsity.

    Starts from the heads `mask` keeps full at `start` (`full_heads(start, shards=shards)`), a near-lossless
    set; each round scores, for every removable unit of the current set (a head, or with `shards` > 1 a layer's
    `shards` lowest-ranked full heads, so each layer keeps a multiple of `shards`: a tensor-parallel cut), the
    NLL increase with that unit compressed too, and compresses the `block` cheapest units together (never past
    the heads kept at `stop`). Rounds re-score every unit against the set as it is, so a head whose partner
    went is scored without it. Returns the mask whose ranking is: the heads left at `stop`, the removed heads
    from last to first removed, then the heads outside the start set in `mask`'s order (so `full_heads(s)` is
    the search's set at every s between start and stop, where the counts meet a round's end), with
    `metadata["elimination"]` recording the rounds; and the rounds.
    `scored` / `on_score`: `LayoutScorer`'s memo and callback (a long search saves and resumes from them).
    """
    from tqdm.auto import tqdm

    from rlkv.ablation import gated_model

    mask.check_compatible(model)
    if not 0.0 <= start < stop < 1.0:
        raise ValueError(f"eliminate needs 0 <= start < stop < 1, got start={start}, stop={stop}")
    if block < 1 or shards < 1 or mask.num_kv_heads % shards:
        raise ValueError(
            f"eliminate needs block >= 1 and shards dividing the {mask.num_kv_heads} KV heads, got block={block}, "
            f"shards={shards}"
        )
    ranking = _ranking(mask)
    h = mask.num_kv_heads
    kept = mask.full_heads(start, shards=shards).view(-1).tolist()
    full = [i for i in ranking if kept[i]]
    floor = int(mask.full_heads(stop, shards=shards).sum())
    rounds: list[EliminationRound] = []
    removed: list[int] = []
    with gated_model(model, sink, local) as gates:
        score = LayoutScorer(model, gates, sequences, batch_size, scored, on_score)
        bar = tqdm(total=len(full) - floor, desc="elimination", disable=not progress, dynamic_ncols=True)
        while len(full) - floor >= shards:
            score.evaluated = set()
            units = _units(full, ranking, h, shards)
            costs = sorted(
                (score.increase([i for i in full if i not in unit]), n, unit) for n, unit in enumerate(units)
            )
            taken, taken_costs = [], []
            for cost, _, unit in costs[:block]:
                if len(full) - len(taken) - len(unit) < floor:
                    break
                taken += unit
                taken_costs += [cost] * len(unit)
            if not taken:
                break
            full = [i for i in full if i not in taken]
            removed += taken
            rounds.append(
                EliminationRound(taken, taken_costs, sorted(full), score.increase(full), len(score.evaluated))
            )
            bar.update(len(taken))
            bar.set_postfix_str(f"{len(full)} full +{rounds[-1].increase:.4f} nats/token", refresh=True)
        bar.close()
    outside = [i for i in ranking if i not in full and i not in removed]
    record = {
        "base_nll": score.base,
        "sink": sink,
        "local": local,
        "start": start,
        "stop": stop,
        "block": block,
        "shards": shards,
        "rounds": [vars(r) for r in rounds],
    }
    return _ranked_mask(full + removed[::-1] + outside, mask, model, "elimination", record), rounds
