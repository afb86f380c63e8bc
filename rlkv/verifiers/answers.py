"""Answer text helpers shared by the verifiers, the chain task and the evaluation harness."""

from __future__ import annotations

import re

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_THINK_END = "</think>"


def strip_thinking(completion: str) -> str:
    """The answer part of a completion: the text after the last `</think>` (all of it if there is none)."""
    head, sep, tail = completion.rpartition(_THINK_END)
    return tail if sep else completion


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces balanced; None if absent or unclosed."""
    for match in reversed(list(_BOX_RE.finditer(text))):
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None
