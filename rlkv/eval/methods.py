"""Evaluation methods by name, each turned into a `CompressionConfig` at a sparsity with matched KV budgets.

Method names
------------
- ``full``: no compression (a plain full KV cache).
- ``rlkv``, ``ablation-mask``, ``random-mask``, ``duo``: a head mask (the trained one, the
  per-head ablation ranking of `rlkv ablation-mask`, seeded random scores, a DuoAttention TSV)
  keeps the top heads full at sparsity `s`; the other heads keep sink + window
  (16 + 64) tokens (RLKV inference). ``random-mask@K`` is the random mask of seed K
  (``random-mask`` uses the config's `random_mask_seed`): list several to average over draws.
- ``<mask>+<policy>`` (e.g. ``rlkv+rkv``, ``rlkv+rpc``): the same heads full, and the token-eviction
  `policy` runs on the compressed heads with the same per-head token count, sink + window (80): a
  smaller forced set (`combo_sink` + `combo_window`, default 16 + 8) leaves the policy real choices.
- any other registered policy (``rkv``, ``h2o``, ``snapkv``, ``rpc``, ``skipkv``; ``streaming`` is
  sink + the most recent tokens, policy ``sink-recent``; ``random-evict`` is policy ``random``: the
  prompt kept, the other tokens evicted uniformly at random): the policy on every head (baseline).
  ``rlkv+random-evict`` works too.

Matching rule (``budget_rule="matched"``, the default)
-----------------------------------------------------
Let N = layers x KV heads, n_c = N - round((1 - s) * N) the heads a mask compresses (so s_eff =
n_c / N is the sparsity a mask really has), o = sink + window = 80 and T the row's real length.
A head-mask method then holds (1 - s_eff) * N * T + s_eff * N * o KV entries: on average
``(1 - s_eff) * T + s_eff * o`` per head. A baseline gets exactly that per head: the dynamic budget
``round((1 - s_eff) * T)`` plus a forced overhead of ``round(s_eff * o)`` tokens (split sink :
window as 16 : 64), so resident KV is equal within one token per head at every length T >= o.
The RLKV appendix instead gives baselines ``(1 - s) * T + 16 + 64`` per head, i.e. (1 - s_eff) * o
more than the head-mask methods: that is ``budget_rule="paper"``. ``budget_rule="fixed"`` gives
baselines a fixed token budget per head (R-KV's setting; not matched). Under the matched rule policies
with a `buffer` get `buffer=0` (compress at every step, so a head never holds budget + buffer), and
periodic policies (RPC) match only right after each compression. Matching assumes the prompt
is evictable (``protect_prompt=False``, as in RLKV where compressed heads keep only sink + local):
a protected prompt stays in every head and breaks the equality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlkv.errors import UserError
from rlkv.head_mask import HeadMask
from rlkv.policies import available as available_policies

if TYPE_CHECKING:
    from rlkv.inference.config import CompressionConfig

MASK_METHODS = ("rlkv", "ablation-mask", "random-mask", "duo")
# mask method -> the EvalConfig field (and `rlkv eval` flag) that names its mask file
MASK_FIELDS = {"rlkv": "head_mask", "ablation-mask": "ablation_mask", "duo": "duo_mask"}
BUDGET_RULES = ("matched", "paper", "fixed")
# Baseline method name -> registered policy, where they differ.
BASELINE_POLICY_ALIASES = {"streaming": "sink-recent", "random-evict": "random"}


class MethodError(ValueError, UserError):
    """An unknown or unusable evaluation method name / setting."""


@dataclass(frozen=True)
class BudgetRule:
    """How methods are sized at a sparsity (see the module docstring).

    kind: "matched" (equal resident KV), "paper" (RLKV appendix: baselines (1 - s) * T + 16 + 64),
        or "fixed" (baselines keep `fixed_budget` tokens per head).
    sink, window: tokens a compressed head always keeps (RLKV inference: 16 + 64).
    combo_sink, combo_window: forced tokens of `<mask>+<policy>` compressed heads (budget sink + window).
    protect_prompt: keep prompt tokens out of eviction (breaks exact matching; see module docstring).
    window_prefill: head-mask methods' compressed heads attend sink + window in the prompt forward too.
    """

    kind: str = "matched"
    sink: int = 16
    window: int = 64
    fixed_budget: int | None = None
    combo_sink: int = 16
    combo_window: int = 8
    protect_prompt: bool = False
    window_prefill: bool = False

    def __post_init__(self) -> None:
        if self.kind not in BUDGET_RULES:
            raise MethodError(f"budget_rule={self.kind!r}: choose one of {BUDGET_RULES}")
        if self.kind == "fixed" and (
            self.fixed_budget is None or self.fixed_budget < self.sink + self.window
        ):
            raise MethodError(
                f"budget_rule='fixed' needs fixed_budget >= sink + window = {self.sink + self.window} "
                f"(got {self.fixed_budget!r})"
            )
        if self.combo_sink + self.combo_window > self.sink + self.window:
            raise MethodError(
                f"combo_sink + combo_window = {self.combo_sink + self.combo_window} must not exceed "
                f"sink + window = {self.sink + self.window} (the compressed heads' token count)"
            )

    @property
    def overhead(self) -> int:
        """Tokens a sink + local compressed head keeps: sink + window."""
        return self.sink + self.window


@dataclass(frozen=True)
class Method:
    """A parsed method name: `mask` (a MASK_METHODS name, `random-mask@K`, or None) and the `policy`
    of the compressed heads."""

    name: str
    mask: str | None
    policy: str | None

    @property
    def is_full(self) -> bool:
        return self.mask is None and self.policy is None


def random_mask_seed(mask: str) -> int | None:
    """The seed K of a ``random-mask@K`` mask name (None for any other name)."""
    base, at, seed = mask.partition("@")
    if base == "random-mask" and at and seed.isdigit():
        return int(seed)
    return None


def is_mask_name(mask: str) -> bool:
    """True for a head-mask method's name (a MASK_METHODS name or `random-mask@K`)."""
    return mask in MASK_METHODS or random_mask_seed(mask) is not None


def parse_method(name: str) -> Method:
    """`Method` for a method name; `MethodError` lists the valid forms."""
    policies = available_policies()
    if name == "full":
        return Method(name, None, None)
    if is_mask_name(name):
        return Method(name, name, "streaming")
    mask, plus, policy = name.partition("+")
    if plus:
        policy = "random" if policy == "random-evict" else policy  # `<mask>+streaming` stays the ring
        if is_mask_name(mask) and policy in policies:
            return Method(name, mask, policy)
    else:
        policy = BASELINE_POLICY_ALIASES.get(name, name)
        if policy in policies and policy != "full":
            return Method(name, None, policy)
    raise MethodError(
        f"unknown method {name!r}: use 'full', a mask method {list(MASK_METHODS)} or 'random-mask@<seed>', "
        f"'<mask>+<policy>' or a baseline policy; registered policies: {policies}"
    )


def effective_sparsity(sparsity: float, num_heads: int) -> float:
    """The fraction of heads a head mask really compresses at `sparsity`: 1 - round((1 - s) * N) / N."""
    return 1.0 - int(round((1.0 - sparsity) * num_heads)) / num_heads


def matched_tokens_per_head(sparsity: float, num_heads: int, length: int, overhead: int = 80) -> float:
    """Mean KV entries per head a head-mask method holds for a row of `length` real tokens (the match target)."""
    if length <= overhead:
        return float(length)
    s = effective_sparsity(sparsity, num_heads)
    return (1.0 - s) * length + s * overhead


def baseline_sizing(sparsity: float, num_heads: int, rule: BudgetRule) -> dict[str, Any]:
    """`budget`, `sink`, `window` of a baseline (policy on every head) at `sparsity` under `rule`."""
    if rule.kind == "fixed":
        return {"budget": int(rule.fixed_budget), "sink": rule.sink, "window": rule.window}
    s = effective_sparsity(sparsity, num_heads)
    if rule.kind == "paper":
        sink, window = rule.sink, rule.window
    else:
        overhead = int(round(s * rule.overhead))
        sink = int(round(s * rule.sink))
        sink, window = sink, overhead - sink
    # every head compressed: the dynamic part is gone, only the overhead stays
    budget: int | float = 1.0 - s if s < 1.0 else sink + window
    return {"budget": budget, "sink": sink, "window": window}


def _policy_kwargs(policy: str, rule: BudgetRule, given: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
    """Constructor kwargs of `policy`: `given`, plus matched-rule and tokenizer defaults it accepts."""
    import inspect

    from rlkv.policies import get_policy_class

    params: set[str] = set()
    for klass in get_policy_class(policy).__mro__:  # a subclass forwarding **kwargs takes its base's too
        signature = inspect.signature(klass.__init__).parameters
        params |= {n for n, p in signature.items() if p.kind is not p.VAR_KEYWORD}
        if not any(p.kind is p.VAR_KEYWORD for p in signature.values()):
            break
    kwargs: dict[str, Any] = {}
    if rule.kind == "matched" and "buffer" in params:
        # a buffer lets a head hold budget + buffer tokens between compressions: not matched
        kwargs["buffer"] = 0
    if tokenizer is not None and "tokenizer" in params:
        kwargs["tokenizer"] = tokenizer  # SkipKV finds sentence delimiters with it
    kwargs.update(given)
    return kwargs


def num_kv_heads_total(model: Any) -> int:
    """L * H_kv of a model (what sparsity fractions count)."""
    from rlkv.head_mask import ModelFingerprint

    fp = ModelFingerprint.of(model)
    return fp.num_hidden_layers * fp.num_key_value_heads


def method_config(
    method: str | Method,
    sparsity: float,
    *,
    model: Any,
    masks: dict[str, HeadMask],
    rule: BudgetRule | None = None,
    policy_kwargs: dict[str, dict[str, Any]] | None = None,
    tokenizer: Any = None,
    window_only: bool = False,
) -> CompressionConfig | None:
    """The `CompressionConfig` of `method` at `sparsity` for `model` (None for `full`).

    window_only: head-mask methods in vLLM's form (`rlkv.inference.vllm.matched_compression`): compressed
        heads a sliding window of sink + window tokens (the same count), sink 0, prompt included.

    masks: head masks by mask-method name ("rlkv", "ablation-mask", "random-mask", "duo"), as needed by `method`.
    policy_kwargs: constructor arguments per policy name (e.g. {"rkv": {"lam": 0.1}}); they win
        over the defaults set here (`buffer=0` under the matched rule, the model's `tokenizer`).
    """
    from rlkv.inference.config import CompressionConfig

    method = parse_method(method) if isinstance(method, str) else method
    rule = rule or BudgetRule()
    if method.is_full:
        return None
    kwargs = _policy_kwargs(method.policy, rule, (policy_kwargs or {}).get(method.policy, {}), tokenizer)
    common = {"policy": method.policy, "policy_kwargs": kwargs, "protect_prompt": rule.protect_prompt}
    if method.mask is None:
        sizing = baseline_sizing(sparsity, num_kv_heads_total(model), rule)
        return CompressionConfig(head_mask=None, sparsity=sparsity, **sizing, **common)
    if method.mask not in masks:
        name = MASK_FIELDS.get(method.mask, "random_mask_seed")
        raise MethodError(
            f"method {method.name!r} needs the {method.mask!r} head mask; set {name} "
            f"(rlkv eval --{name.replace('_', '-')})"
        )
    mask = masks[method.mask]
    mask.check_compatible(model)
    if method.policy == "streaming" and window_only:
        from rlkv.inference.vllm import matched_compression

        return matched_compression(mask, sparsity, window=rule.overhead)
    if method.policy == "streaming":
        return CompressionConfig(
            head_mask=mask,
            sparsity=sparsity,
            sink=rule.sink,
            window=rule.window,
            window_prefill=rule.window_prefill,
            **common,
        )
    return CompressionConfig(
        head_mask=mask,
        sparsity=sparsity,
        budget=rule.overhead,
        sink=rule.combo_sink,
        window=rule.combo_window,
        **common,
    )
