"""`CompressionConfig`: which heads keep a full KV cache and how the others are compressed."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkv.errors import UserError
from rlkv.head_mask import HeadMask, HeadMaskError
from rlkv.head_mask.fingerprint import check_sparsity


class CompressionConfigError(ValueError, UserError):
    """A `CompressionConfig` field with an invalid value (the message names the field and the fix)."""


def check_prompt_form(protect_prompt: bool, window_prefill: bool) -> None:
    """The one rule on how the compressed heads read the prompt, for every entry point (`CompressionConfig`,
    `rlkv serve` / `export-vllm`, `EvalConfig`): a protected prompt is read and kept whole, a windowed one is
    read through the window, so the two cannot be asked together. Raises `CompressionConfigError`."""
    if protect_prompt and window_prefill:
        raise CompressionConfigError(
            "protect_prompt=True with window_prefill=True: a protected prompt is read and kept whole, a windowed "
            "prompt is read through the window; set one of them to False (--protect-prompt / --window-prefill)"
        )


MAX_TOKENS = 1 << 30  # a token count beyond any context length: larger values are typos or overflows


@dataclass
class CompressionConfig:
    """How a `HeadMixedCache` is laid out and compressed.

    head_mask: HeadMask, anything `HeadMask.from_pretrained` reads (a mask folder or Hub repo id,
        a head_mask.json, an RLKV-authors `adapter_weights.tsv` or DuoAttention folder), or None
        (no mask: the policy compresses every head, the baseline mode of R-KV / H2O / ...).
    sparsity: fraction of KV heads compressed, in [0, 1]; the mask keeps the top
        round((1 - sparsity) * L * H) heads full. Ignored without a mask.
    policy: registered policy name for the compressed heads (`rlkv.policies.available()`).
    policy_kwargs: constructor arguments of the policy.
    budget: evictable tokens kept per compressed head: int = tokens (sink and window included),
        float in (0, 1] = ratio of the row's current length plus sink + window (RLKV's dynamic
        budget), None = the policy's default. Streaming ignores it (it keeps sink + window).
    sink, window: tokens always kept at the start and the end of each row (RLKV inference: 16, 64).
    protect_prompt: never evict prompt tokens (they do not count against the budget).
    min_full_per_layer: keep at least this many full heads in every layer.
    window_prefill: compressed heads attend sink + window in the prompt forward too, each query to its own
        last `window` tokens (vLLM's sliding-window heads, DuoAttention's streaming heads), instead of the
        whole prompt before it is compressed; policy "streaming" only. With sink 0 this is what rlkv's
        vLLM plugin serves (`rlkv.inference.vllm.matched_compression`).
    """

    head_mask: HeadMask | str | os.PathLike | None = None
    sparsity: float = 0.5
    policy: str = "streaming"
    policy_kwargs: dict[str, Any] = field(default_factory=dict)
    budget: int | float | None = None
    sink: int = 16
    window: int = 64
    protect_prompt: bool = True
    min_full_per_layer: int = 0
    window_prefill: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `CompressionConfigError` for the first invalid field (model-independent checks)."""
        from rlkv.policies import UnknownPolicyError, get_policy_class

        try:
            check_sparsity(self.sparsity)
        except HeadMaskError as e:
            raise CompressionConfigError(str(e)) from None
        for name in ("sink", "window", "min_full_per_layer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
                raise CompressionConfigError(f"{name}={value!r}: must be an integer from 0 to {MAX_TOKENS}")
        b = self.budget
        if isinstance(b, bool) or not (b is None or isinstance(b, (int, float))):
            raise CompressionConfigError(
                f"budget={b!r}: must be an int (tokens), a float ratio in (0, 1], or None"
            )
        if isinstance(b, float) and not 0.0 < b <= 1.0:
            raise CompressionConfigError(
                f"budget={b!r}: a float budget is a ratio of the current length, in (0, 1]"
            )
        if isinstance(b, int) and b > MAX_TOKENS:
            raise CompressionConfigError(
                f"budget={b}: more tokens than any context ({MAX_TOKENS}); use None for no limit"
            )
        if isinstance(b, int) and b < 1:
            raise CompressionConfigError(
                f"budget={b}: a compressed head would keep no token and attend to nothing but itself; give a "
                "budget of at least 1 token (sink + window included), or a ratio in (0, 1]"
            )
        if isinstance(b, int) and b < self.sink + self.window:
            raise CompressionConfigError(
                f"budget={b} is smaller than sink + window = {self.sink} + {self.window}; raise the budget or "
                "lower sink/window (the budget counts them)"
            )
        if not isinstance(self.window_prefill, bool):
            raise CompressionConfigError(f"window_prefill={self.window_prefill!r}: must be True or False")
        if self.window_prefill and self.policy != "streaming":
            raise CompressionConfigError(
                f"window_prefill=True with policy={self.policy!r}: a windowed prompt forward is the streaming "
                "policy's form; use policy='streaming' or window_prefill=False"
            )
        check_prompt_form(self.protect_prompt, self.window_prefill)
        if not isinstance(self.policy_kwargs, dict):
            raise CompressionConfigError(
                f"policy_kwargs={self.policy_kwargs!r}: must be a dict of keyword arguments"
            )
        try:
            get_policy_class(self.policy)
        except UnknownPolicyError as e:
            raise CompressionConfigError(f"policy={self.policy!r}: {e}") from None
        if self.head_mask is not None and not isinstance(self.head_mask, (HeadMask, str, os.PathLike)):
            raise CompressionConfigError(
                f"head_mask has type {type(self.head_mask).__name__}: pass a HeadMask, a path or Hub id "
                "(HeadMask.from_pretrained), or None"
            )

    def resolve_head_mask(self, model: Any = None) -> HeadMask | None:
        """The head mask as a `HeadMask` (read by `HeadMask.from_pretrained` if a path or Hub id), or None.

        `model` (a model, a meta-device model or a config) is needed to read a TSV mask.
        """
        if self.head_mask is None or isinstance(self.head_mask, HeadMask):
            return self.head_mask
        return HeadMask.from_pretrained(self.head_mask, model)

    def full_heads(self, model: Any, shards: int = 1) -> torch.Tensor | None:
        """BoolTensor[L, H_kv] of full heads for `model`, or None (no mask: all heads compressed).

        shards: every layer's full-head count a multiple of it (vLLM tensor parallelism; `HeadMask.full_heads`).
        Raises `HeadMaskError` when the mask was made for another model.
        """
        mask = self.resolve_head_mask(model)
        if mask is None:
            return None
        mask.check_compatible(model)
        try:
            return mask.full_heads(self.sparsity, min_full_per_layer=self.min_full_per_layer, shards=shards)
        except HeadMaskError as e:
            if shards != 1:  # the mask's message names the shard count or the per-layer minimum
                raise CompressionConfigError(str(e)) from None
            raise CompressionConfigError(f"min_full_per_layer={self.min_full_per_layer}: {e}") from None
