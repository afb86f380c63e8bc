"""Reward functions in TRL's signature: `reward(prompts, completions, **columns) -> list[float]`.

TRL passes every dataset column as a keyword list aligned with `completions` (e.g. `answer`,
`source`, `metadata`), plus `completion_ids`, `trainer_state`, `log_extra`, `log_metric`.
Completions are strings, or message lists for conversational datasets (the last message is read).

- `boxed_math_reward`: 1.0 when the last `\\boxed{}` answer equals the `answer` column (math-verify).
- `verifier_reward`: dispatches each row to the verifier registered for its `source` column
  (`rlkv.verifiers`), so procedural datasets (reasoning-gym, the demo chain task, code) plug in.
- `reward_from_verifier(fn)`: the hook that turns any `fn(completion, example) -> bool | float`
  into a reward function.

Bad model output never raises: parse failures, timeouts and verifier exceptions give 0.0.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from rlkv.verifiers.verify import get_verifier, verify_math

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float]]

# keyword arguments TRL adds that are not dataset columns
_TRL_EXTRAS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def completion_text(completion: Any) -> str:
    """The generated text of one completion: the string itself, or the last message's content."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content", "")
        if isinstance(content, list):  # content blocks
            return "".join(part.get("text", "") for part in content if isinstance(part, dict))
        return str(content)
    return str(completion)


def _rows(completions: Sequence[Any], columns: dict[str, Any]) -> list[dict[str, Any]]:
    """One example dict per completion from the column lists TRL passes."""
    n = len(completions)
    data = {k: v for k, v in columns.items() if k not in _TRL_EXTRAS and isinstance(v, list) and len(v) == n}
    return [{k: v[i] for k, v in data.items()} for i in range(n)]


def boxed_math_reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the completion's last `\\boxed{...}` matches `answer` (math-verify), else 0.0."""
    return [1.0 if verify_math(completion_text(c), str(a)) else 0.0 for c, a in zip(completions, answer)]


def reward_from_verifier(fn: Callable[[str, dict], bool | float], name: str | None = None) -> RewardFunc:
    """Wrap `fn(completion_text, example) -> bool | float` as a TRL reward function.

    `example` holds the row's dataset columns. Exceptions from `fn` are logged and scored 0.0
    (a verifier must not stop training on one odd completion).
    """

    def reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
        scores = []
        for completion, example in zip(completions, _rows(completions, kwargs)):
            try:
                scores.append(float(fn(completion_text(completion), example)))
            except Exception:
                logger.warning("verifier %s raised; scoring 0", reward.__name__, exc_info=True)
                scores.append(0.0)
        return scores

    reward.__name__ = name or getattr(fn, "__name__", "verifier_reward")
    return reward


def verifier_reward(prompts: list, completions: list, source: list[str], **kwargs: Any) -> list[float]:
    """1.0 when the verifier registered for the row's `source` accepts the completion, else 0.0.

    An unknown `source` is a configuration error and raises KeyError (naming the known sources).
    """
    verifiers = {s: get_verifier(s) for s in set(source)}
    rows = _rows(completions, {"source": source, **kwargs})
    scores = []
    for completion, example in zip(completions, rows):
        try:
            scores.append(float(bool(verifiers[example["source"]](completion_text(completion), example))))
        except Exception:
            logger.warning("verifier for source %r raised; scoring 0", example["source"], exc_info=True)
            scores.append(0.0)
    return scores


REWARDS: dict[str, RewardFunc] = {"math": boxed_math_reward, "verify": verifier_reward}


def get_reward(name: str) -> RewardFunc:
    """A reward function by registry name (`math`, `verify`) or import path `package.module:function`."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward {name!r}: cannot import {attr} from {module_name} ({e})") from None
        if not callable(fn):
            raise ValueError(f"reward {name!r} is not callable")
        return fn
    raise ValueError(
        f"unknown reward {name!r}: use one of {sorted(REWARDS)} or an import path 'module:function'"
    )
