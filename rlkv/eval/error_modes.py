"""Error modes of compressed generations (RLKV section 5) and a repetition detector with early stop.

A generation that fails where the full-KV model succeeds is one of:

- ``repetitive``: it fell into a loop. `RepetitionRule.is_repetitive(token_ids)` is True when
  either (a) the reference rule holds: at least `window` (400) tokens were generated and fewer
  than `min_unique_ratio` (10%) of the last `window` tokens are distinct, or (b) the tail is an
  exact loop: the last `max(min_loop_tokens, min_repeats * p)` tokens repeat with some period
  `p <= max_period` (a unit of p tokens written at least `min_repeats` times in a row). Rule (b)
  catches loops in outputs shorter than the reference window and loops over a large vocabulary;
  rule (a) catches near-loops whose unit drifts slightly.
- ``overlength``: not repetitive, stopped because it hit `max_new_tokens`.
- ``incorrect``: not repetitive, finished (end of sequence or a stop rule), wrong answer.

Repetition is checked first: a loop usually also runs into the length limit, and the loop is the
cause worth reporting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlkv.eval.stopping import GeneratedTokens

ERROR_MODES = ("repetitive", "overlength", "incorrect")


@dataclass(frozen=True)
class RepetitionRule:
    """When a token sequence counts as a repetition loop (see the module docstring)."""

    window: int = 400
    min_unique_ratio: float = 0.1
    max_period: int = 64
    min_repeats: int = 4
    min_loop_tokens: int = 64

    def __post_init__(self) -> None:
        for name in ("window", "max_period", "min_repeats", "min_loop_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"RepetitionRule.{name}={getattr(self, name)!r} must be a positive integer")
        if not 0.0 < self.min_unique_ratio <= 1.0:
            raise ValueError(f"RepetitionRule.min_unique_ratio={self.min_unique_ratio!r} must be in (0, 1]")

    def is_repetitive(self, token_ids: Sequence[int]) -> bool:
        """True when the generated `token_ids` end in a repetition loop."""
        return self.low_diversity(token_ids) or self.loop_period(token_ids) is not None

    def low_diversity(self, token_ids: Sequence[int]) -> bool:
        """Reference rule: >= `window` tokens and < `min_unique_ratio` of the last `window` distinct."""
        if len(token_ids) < self.window:
            return False
        tail = list(token_ids[-self.window :])
        return len(set(tail)) < self.min_unique_ratio * self.window

    def loop_period(self, token_ids: Sequence[int]) -> int | None:
        """Smallest period p <= max_period with which the tail repeats (see module docstring), else None."""
        ids = list(token_ids)
        for period in range(1, self.max_period + 1):
            span = max(self.min_loop_tokens, self.min_repeats * period)
            if span > len(ids):
                break
            tail = ids[-span:]
            if all(tail[i] == tail[i - period] for i in range(period, span)):
                return period
        return None


def classify_error(
    *, correct: bool, finish_reason: str, token_ids: Sequence[int], rule: RepetitionRule | None = None
) -> str | None:
    """The error mode of one generation: None when correct, else one of `ERROR_MODES`.

    finish_reason: "eos" or "stop" (finished: EOS, a stop rule), "length" (hit max_new_tokens) or
    "repetition" (stopped early by `RepetitionStop`, always repetitive).
    """
    if correct:
        return None
    rule = rule or RepetitionRule()
    if finish_reason == "repetition" or rule.is_repetitive(token_ids):
        return "repetitive"
    if finish_reason == "length":
        return "overlength"
    return "incorrect"


class RepetitionStop(GeneratedTokens):
    """A transformers stopping criterion that ends a row once its generated tokens are repetitive.

    Rows are checked every `every` steps so the check stays cheap; `ended(row, num_generated)` tells
    whether it ended a row of the last batch (use one instance per `generate` call).
    """

    def __init__(self, rule: RepetitionRule | None = None, every: int = 16):
        super().__init__()
        self.rule = rule or RepetitionRule()
        self.every = max(1, int(every))

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        generated = self._generated(input_ids)
        if generated % self.every == 0:
            for row in range(input_ids.shape[0]):
                if not self._stopped[row] and self.rule.is_repetitive(
                    input_ids[row, self._prompt_length :].tolist()
                ):
                    self._flag(row, generated)
        return self._stopped.to(input_ids.device).clone()
