"""Which rows of a batch ended, known on the host without a device read per decode step.

`RowEnds` (a transformers `StoppingCriteria`) keeps each row's end on the device and reads it every
`ROW_END_READ_EVERY` steps; `host_row_ends` pairs it with transformers' decode loop, so `generate`, the
rollouts and the trainer's sampling stop on what the host knows (docs/design.md, "No host sync in a
decode step").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from rlkv.cache.stats import CacheStats
from rlkv.compat import host_stop_check

# Finished rows are read back every ROW_END_READ_EVERY decode steps, not at every step: each read
# makes the host wait for the device (docs/design.md, "No host sync in a decode step").
ROW_END_READ_EVERY = 16


class RowEnds(StoppingCriteria):
    """A transformers `StoppingCriteria` that knows, on the host, which rows ended, reading the device
    only every `every` calls: each row's end (EOS, or one of `criteria`), and its cache stats at that
    step (later steps of its batch only feed it padding, which must not count). Stops the rows that
    `criteria` stop, and records in `stopped` the sequence width at which `criteria` (not EOS) ended
    a row. `host_row_ends` pairs it with transformers' decode loop.

    The width at which each row ended stays on the device and is read every `every` calls (and by
    `read()` after generation); `snapshot()` (host values only) is taken at every call, and
    `stats_at(snapshot)` turns the one of a row's end step into its `CacheStats` when it is read
    (both None: no stats).
    """

    def __init__(
        self,
        eos: set[int],
        criteria: list[Any] | None = None,
        snapshot: Callable[[], Any] | None = None,
        stats_at: Callable[[Any], list[CacheStats]] | None = None,
        every: int = ROW_END_READ_EVERY,
    ) -> None:
        self.snapshot, self.stats_at, self.every = snapshot, stats_at, every
        self.eos, self.criteria = sorted(eos), StoppingCriteriaList(criteria or [])
        self.stats: dict[int, CacheStats] = {}
        self.stopped: dict[int, int] = {}
        self.ended: set[int] = set()  # rows seen ended by a read
        self._eos: torch.Tensor | None = None  # the EOS ids on the device, built once
        self._end: torch.Tensor | None = None  # LongTensor[B]: width at which each row ended, 0 = not yet
        self._by_criteria: torch.Tensor | None = None  # BoolTensor[B]: `criteria` (not EOS) ended it
        self._snapshots: dict[int, Any] = {}  # width -> snapshot, since the last read

    def __call__(
        self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any
    ) -> torch.BoolTensor:
        width = input_ids.shape[1]
        if self._eos is None:
            self._eos = torch.tensor(self.eos, device=input_ids.device)
            self._end = input_ids.new_zeros(input_ids.shape[0])
            self._by_criteria = torch.zeros_like(self._end, dtype=torch.bool)
        eos = torch.isin(input_ids[:, -1], self._eos)
        done = eos | self.criteria(input_ids, scores, **kwargs) if self.criteria else eos
        newly = done & (self._end == 0)
        self._end = torch.where(newly, width, self._end)
        self._by_criteria = self._by_criteria | (newly & ~eos)
        self._snapshots[width] = self.snapshot() if self.snapshot is not None else None
        if len(self._snapshots) >= self.every:
            self.read()
        return done

    def all_ended(self) -> bool:
        """Whether the last read saw every row end (host only)."""
        return self._end is not None and len(self.ended) == self._end.shape[0]

    def read(self) -> None:
        """Record the rows that ended since the last read: their stats and `stopped` widths (one host read)."""
        if self._end is None:
            return
        ends, by_criteria = torch.stack([self._end, self._by_criteria.long()]).tolist()
        at_width: dict[int, list[CacheStats]] = {}
        for row, (end, stopped) in enumerate(zip(ends, by_criteria, strict=True)):
            if end and row not in self.ended:
                self.ended.add(row)
                if self.stats_at is not None:
                    if end not in at_width:
                        at_width[end] = self.stats_at(self._snapshots[end])
                    self.stats[row] = at_width[end][row]
                if stopped:
                    self.stopped[row] = end
        self._snapshots.clear()


@contextlib.contextmanager
def host_row_ends(
    eos_token_ids: set[int] | list[int],
    input_width: int,
    generation_config: Any,
    criteria: list[Any] | None = None,
    snapshot: Callable[[], Any] | None = None,
    stats_at: Callable[[Any], list[CacheStats]] | None = None,
) -> Iterator[RowEnds]:
    """Within the block, transformers' `generate` over `input_width` prompt columns with
    `generation_config` stops on what a `RowEnds` (EOS or `criteria`; `snapshot` / `stats_at` as it
    takes them) has read on the host, every ROW_END_READ_EVERY steps, instead of reading the device at
    every step. Yields that `RowEnds`: pass `StoppingCriteriaList([ends])` as the `generate` call's
    `stopping_criteria`. Rows that ended receive padding until the next read (up to
    ROW_END_READ_EVERY - 1 extra columns), which the caller trims at the first EOS (or `stopped`).
    """
    ends = RowEnds(set(eos_token_ids), criteria, snapshot, stats_at)
    new = generation_config.max_new_tokens
    # the limit transformers itself derives (GenerationMixin._prepare_generated_length)
    limit = input_width + new if new is not None else generation_config.max_length
    with host_stop_check(limit, ends.all_ended):
        yield ends
