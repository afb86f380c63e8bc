"""Where an eval generation ends before EOS: stop rules per benchmark (finish reason "stop").

A `StopRule` ends a row at the first of: one of its `strings` (transformers' `StopStringCriteria`:
the text ends with it) or, with `code_block`, the closing fence of the first fenced code block
(`CodeBlockStop`), the standard protocol for code benchmarks, where an instruct model otherwise
keeps explaining its code until the length cap. Code benchmarks (`DEFAULT_STOP`) stop at the end of
their first code block unless `EvalConfig.stop` says otherwise.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import StoppingCriteria

FENCE = "```"
# benchmark names (lower case) -> their default rule (HumanEval / MBPP by name or hub id)
DEFAULT_STOP: dict[str, dict[str, Any]] = dict.fromkeys(
    ("humaneval", "openai/openai_humaneval", "mbpp", "google-research-datasets/mbpp"), {"code_block": True}
)


@dataclass(frozen=True)
class StopRule:
    """Stop a row once its text ends with one of `strings`, or (`code_block`) its first fenced code block closes."""

    strings: tuple[str, ...] = ()
    code_block: bool = False

    @classmethod
    def from_dict(cls, doc: Any, where: str) -> StopRule:
        """From a recipe mapping {strings: [...], code_block: bool}; errors name `where` and the fix."""
        if not isinstance(doc, dict) or set(doc) - {"strings", "code_block"}:
            raise ValueError(
                f"{where}: a stop rule is a mapping with keys 'strings' (a list of stop strings) and/or "
                f"'code_block' (true: stop at the end of the first fenced code block), got {doc!r}"
            )
        strings = doc.get("strings", [])
        if isinstance(strings, str) or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"{where}.strings: give a list of non-empty strings, got {strings!r}")
        if not isinstance(doc.get("code_block", False), bool):
            raise ValueError(f"{where}.code_block: must be true or false, got {doc['code_block']!r}")
        return cls(strings=tuple(strings), code_block=doc.get("code_block", False))

    def to_dict(self) -> dict[str, Any]:
        """The recipe mapping of this rule."""
        return {**asdict(self), "strings": list(self.strings)}

    def __bool__(self) -> bool:
        return bool(self.strings) or self.code_block


def stop_rule(benchmark: str, stop: dict[str, Any] | None) -> StopRule:
    """The rule of `benchmark`: its entry in `stop` (a benchmark missing there has none), or with
    `stop` None the default (`DEFAULT_STOP`: code benchmarks stop at the end of their first code block)."""
    doc = DEFAULT_STOP.get(benchmark.lower()) if stop is None else stop.get(benchmark)
    return StopRule() if doc is None else StopRule.from_dict(doc, f"stop[{benchmark!r}]")


class GeneratedTokens(StoppingCriteria):
    """Base of criteria that read each row's generated tokens: finds the prompt width of every `generate`
    call from its first check (one token generated) and keeps per-row `stopped` flags of the call, with
    the number of generated tokens at which each row was flagged."""

    def __init__(self) -> None:
        self._prompt_length = 0
        self._last_width = 0
        self._stopped: torch.Tensor | None = None
        self._stopped_at: list[int | None] = []

    def _generated(self, input_ids: torch.Tensor) -> int:
        """Call first in `__call__`: starts a new generate call when needed; returns the tokens generated so far."""
        batch, width = input_ids.shape
        if self._stopped is None or self._stopped.shape[0] != batch or width <= self._last_width:
            # a new generate call: its first check comes right after the first new token
            self._stopped = torch.zeros(batch, dtype=torch.bool)
            self._stopped_at = [None] * batch
            self._prompt_length = width - 1
        self._last_width = width
        return width - self._prompt_length

    def _flag(self, row: int, generated: int) -> None:
        """Mark `row` stopped after `generated` tokens."""
        self._stopped[row] = True
        self._stopped_at[row] = generated

    @property
    def stopped_rows(self) -> list[bool]:
        """Per batch row of the last generate call: whether this criterion flagged it."""
        return [] if self._stopped is None else self._stopped.tolist()

    def ended(self, row: int, num_generated: int) -> bool:
        """Whether this criterion ended `row` of the last call, whose output has `num_generated` tokens.

        A row another criterion ended earlier keeps receiving pad tokens until the whole batch is done,
        and this criterion may flag it on those (a run of pads looks like a loop); it ended the row only
        if it flagged it by the row's last real token.
        """
        at = self._stopped_at[row] if row < len(self._stopped_at) else None
        return at is not None and at <= num_generated


def closes_first_code_block(text: str) -> bool:
    """True once `text` holds an opening fence line and, after it, the closing fence."""
    start = text.find(FENCE)
    line_end = text.find("\n", start + len(FENCE)) if start >= 0 else -1
    return line_end >= 0 and text.find(FENCE, line_end + 1) >= 0


class CodeBlockStop(GeneratedTokens):
    """Ends a row at the token that closes the first fenced code block of its generated text.

    The text is decoded only at steps whose new token holds a backtick (a fence can close only then).
    """

    def __init__(self, tokenizer: Any) -> None:
        super().__init__()
        self.tokenizer = tokenizer

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        generated = self._generated(input_ids)
        last = self.tokenizer.batch_decode(input_ids[:, -1:].tolist())
        for row, piece in enumerate(last):
            if not self._stopped[row] and "`" in piece:
                text = self.tokenizer.decode(input_ids[row, self._prompt_length :].tolist())
                if closes_first_code_block(text):
                    self._flag(row, generated)
        return self._stopped.to(input_ids.device).clone()


def stop_criteria(rule: StopRule, tokenizer: Any) -> tuple[list[StoppingCriteria], list[str] | None]:
    """The `generate` arguments of `rule`: (stopping_criteria, stop_strings)."""
    return ([CodeBlockStop(tokenizer)] if rule.code_block else []), (list(rule.strings) or None)
