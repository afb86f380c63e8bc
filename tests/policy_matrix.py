"""The policy test matrix (as kvpress's tests/default_presses.py): one entry per registered policy.

Each entry says how to build the policy (`kwargs(tokenizer)` for `get_policy(name, **kwargs)`),
the cache settings under which nothing is evicted (`identity`), and settings plus a generation
length under which it evicts (`evicting`; None for a policy that never evicts). Adding a policy
means adding its row here; tests/test_policy_matrix.py fails for a registered name without one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class MatrixEntry:
    kwargs: Callable[[Any], dict[str, Any]] = lambda tokenizer: {}
    identity: dict[str, Any] = field(default_factory=lambda: {"budget": 10_000})
    identity_tokens: int = 16
    evicting: dict[str, Any] | None = None
    evicting_tokens: int = 20


POLICY_MATRIX: dict[str, MatrixEntry] = {
    "full": MatrixEntry(),
    "streaming": MatrixEntry(
        identity={"window": 10_000}, evicting={"sink": 2, "window": 4}, evicting_tokens=12
    ),
    "sink-recent": MatrixEntry(evicting={"budget": 8, "sink": 2, "window": 2}, evicting_tokens=12),
    "rkv": MatrixEntry(
        kwargs=lambda tokenizer: {"buffer": 4}, evicting={"budget": 12, "sink": 2, "window": 2}
    ),
    "skipkv": MatrixEntry(
        kwargs=lambda tokenizer: {"tokenizer": tokenizer, "buffer": 4},
        evicting={"budget": 12, "sink": 2, "window": 2},
    ),
    "rpc": MatrixEntry(
        kwargs=lambda tokenizer: {"interval": 8, "selector_window": 4},
        identity_tokens=28,
        evicting={},
        evicting_tokens=28,
    ),
    "h2o": MatrixEntry(evicting={"budget": 8, "sink": 1, "window": 2}, evicting_tokens=16),
    # 20 tokens at these settings keep different positions for the 1-token row batched vs alone
    # (its tokens match): see the report of issue 17; 30 tokens is what test_policy_snapkv runs
    "snapkv": MatrixEntry(
        kwargs=lambda tokenizer: {"buffer": 4},
        evicting={"budget": 12, "sink": 1, "window": 2},
        evicting_tokens=30,
    ),
    "random": MatrixEntry(evicting={"budget": 8, "sink": 1, "window": 2}, evicting_tokens=16),
    "knorm": MatrixEntry(evicting={"budget": 8, "sink": 1, "window": 2}, evicting_tokens=16),
}
