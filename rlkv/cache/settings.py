"""What every compressed layer of one cache shares: the policy and the budget definition."""

from __future__ import annotations

from rlkv.policies.base import CompressionPolicy


class CompressionSettings:
    """What every layer of one cache shares: the policy and the budget definition."""

    def __init__(
        self,
        policy: CompressionPolicy,
        sink: int,
        window: int,
        budget: int | float | None,
        protect_prompt: bool,
        window_prefill: bool = False,
    ) -> None:
        self.policy = policy
        self.sink = int(sink)
        self.window = int(window)
        self.budget = budget if budget is not None else policy.default_budget
        self.protect_prompt = bool(protect_prompt)
        # compressed heads attend sink + window in the prompt forward too, query by query (vLLM's
        # sliding-window heads, the gates' training attention) instead of the whole prompt
        self.window_prefill = bool(window_prefill)
