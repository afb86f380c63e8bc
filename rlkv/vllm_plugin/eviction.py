"""Token eviction on vLLM's compressed heads: a fixed-capacity KV cache group whose slots a policy chooses.

The transformers path's budget rule, on vLLM's pages (docs/design.md, "Token eviction on vLLM"):

- `EvictionSpec`: an attention spec of a type of its own (vLLM's hybrid manager puts these layers in
  groups of their own) carrying the compression settings as plain data: the policy's name and
  constructor arguments, the budget (an int, or a ratio of the row's real tokens), sink, window and
  whether the prompt is protected. Its schedule is `rlkv.cache.static.budget`'s (`StaticForm`,
  `RowSchedule`): the same host-known compactions as rlkv's transformers caches.
- Slots, not positions: a request's slot j holds some token of its history; the prompt fills slots
  [0, P) while it is computed (read in full by every prompt query, as on transformers), then a
  compaction packs what the policy keeps into the leading slots, and each generated token goes to the
  first free slot. Keys are stored after RoPE, so attention over the slots in any order is attention at
  the tokens' logical positions.
- `EvictionManager`: allocates like full attention while the prompt is computed, then holds
  `slots_needed(n)` slots: the blocks of the prompt beyond the kept ones go back to vLLM's pool once
  the first generated token is computed (the prompt's compaction runs before that token's attention),
  and a ratio budget's growth appends blocks at the end of the request's list
  (`block_index` maps a slot to its place in the list).

`prompt` below is where a request's prefill ends (vLLM's `prefill_end`): its prompt, or for a request
that was preempted and resumed, everything it recomputes (then compressed as one prompt).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from functools import cached_property
from typing import Any

from vllm.model_executor.layers.attention import Attention
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec

from rlkv.vllm_plugin.fence import cpu_attention_isa, current_vllm_config, register_kv_cache_spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvictionSpec(AttentionSpec):
    """A full-attention page whose requests keep at most `slots_needed(n)` slots once their prompt is done.

    policy: a registered policy name (`split.EVICTION_POLICIES`); policy_kwargs: its constructor arguments as
    JSON (sorted keys); budget: evictable tokens a head keeps (an int) or the ratio of the row's real
    tokens (a float, plus sink + window); sink, window: forced tokens; protect_prompt: the prompt is
    never evicted; max_len: the engine's max_model_len (a ratio budget's region is sized from it); bucket:
    the split's compressed spec bucket (`groups.plan_groups`).
    """

    policy: str = "rkv"
    policy_kwargs: str = "{}"
    budget: float | int = 0
    sink: int = 0
    window: int = 0
    protect_prompt: bool = False
    max_len: int = 0
    bucket: int = 0

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """A whole prompt may be held while it is computed (as full attention)."""
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        return all(isinstance(s, EvictionSpec) and s.rule == self.rule for s in kv_cache_specs.values())

    @property
    def rule(self) -> tuple:
        return self.policy, self.policy_kwargs, self.budget, self.sink, self.window, self.protect_prompt

    def settings(self) -> Any:
        """The `CompressionSettings` these layers compress with (a fresh policy instance)."""
        from rlkv.cache.settings import CompressionSettings
        from rlkv.policies import get_policy

        policy = get_policy(self.policy, **json.loads(self.policy_kwargs))
        return CompressionSettings(policy, self.sink, self.window, self.budget, self.protect_prompt)

    @cached_property
    def form(self) -> Any:
        """The `StaticForm` of these settings (`rlkv.cache.static.budget.static_form`), sized for max_len."""
        from rlkv.cache.static.budget import static_form

        return static_form(self.settings(), True, self.max_len)

    def budget_at(self, length: int) -> int:
        """Evictable tokens a head may keep once the request holds `length` real tokens."""
        return self.form.row_budgets([length], 0)[0]

    def slots_needed(self, length: int, prompt: int) -> int:
        """Slots a request uses at most once its `length`-th token is written (every one during the prompt)."""
        if length <= prompt:
            return length
        early = prompt if self.protect_prompt else 0
        return min(length, early + self.budget_at(length) + self.form.slack)

    def kept_prompt_blocks(self, prompt: int) -> int:
        """Leading blocks of the prompt a request keeps after its prompt's compaction."""
        return min(
            cdiv(prompt, self.block_size), cdiv(self.slots_needed(prompt + 1, prompt), self.block_size)
        )

    def list_blocks(self, length: int, prompt: int) -> int:
        """Blocks in the request's list (freed ones included, as vLLM's null block) at `length` tokens."""
        if length <= prompt:
            return cdiv(length, self.block_size)
        grown = cdiv(self.slots_needed(length, prompt), self.block_size) - self.kept_prompt_blocks(prompt)
        return cdiv(prompt, self.block_size) + max(0, grown)

    def block_index(self, slot: int, prompt: int) -> int:
        """Index in the request's block list of the block holding slot `slot` (after the prompt)."""
        block, kept = slot // self.block_size, self.kept_prompt_blocks(prompt)
        return block if block < kept else cdiv(prompt, self.block_size) + block - kept


# per block pool (one per engine), the KV cache group whose eviction manager logs each request's compactions:
# the first one made, so that a split whose layers fill several eviction groups (all on one schedule) logs once
# per request (an int value: a manager would keep its pool, the key, alive)
_REPORTERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOG = logging.getLogger("vllm.rlkv")


class EvictionManager(FullAttentionManager):
    """Blocks of an `EvictionSpec` group: every block during the prompt, then `slots_needed` slots.

    No prefix caching: after a compaction a block holds other tokens than its hash says. When a request's
    blocks are released (finished, aborted or preempted) one manager per engine logs how many compactions
    its evicting heads ran (`compactions`, the schedule the attention backend follows).
    """

    def __init__(self, kv_cache_spec: EvictionSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.spec = kv_cache_spec
        self.prompt: dict[str, int] = {}  # request id -> where its prefill ends (set at its first blocks)
        self.tokens: dict[str, int] = {}  # request id -> tokens once its latest scheduled step has run
        self.reports = (
            _REPORTERS.setdefault(self.block_pool, self.kv_cache_group_id) == self.kv_cache_group_id
        )

    def compactions(self, request_id: str) -> int:
        """Compactions the request's evicting heads have run: its prompt's at its first generated step when
        due, then each due decode step's (`RowSchedule`, as the backend's builder runs it)."""
        from rlkv.cache.static.budget import RowSchedule

        prompt, tokens = self.prompt.get(request_id), self.tokens.get(request_id, 0)
        if prompt is None or tokens <= prompt:
            return 0
        schedule = RowSchedule(self.spec.form, [prompt])
        return sum(schedule.due(g) for g in range(tokens - prompt + 1))

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any) -> Any:
        """No hit: the group's blocks are rewritten by compactions."""
        names = ("block_hashes", "max_length", "kv_cache_group_ids")
        groups = dict(zip(names, args)) | kwargs
        return tuple([] for _ in groups["kv_cache_group_ids"]), 0

    def cache_blocks(self, *args: Any, **kwargs: Any) -> None:
        return None

    def _tokens(self, request_id: str, num_tokens: int) -> int:
        prompt = self.prompt.get(request_id, num_tokens)
        return self.spec.list_blocks(num_tokens, prompt) * self.block_size

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        *args: Any,
        **kwargs: Any,
    ) -> int:
        prompt = self.prompt.get(request_id) if self.req_to_blocks.get(request_id) else None
        if prompt is None:  # a new or resumed request: its prefill's end
            prompt = int(kwargs.get("prefill_end") or num_tokens)
        if total_computed_tokens < prompt:
            # the backend computes a row of several queries as prompt: a replay after a preemption computes
            # one token past vLLM's prefill_end (its last output, which vLLM counts as decode)
            prompt = max(prompt, num_tokens)
        self.prompt[request_id] = prompt
        if self.reports:  # only the reporting group's manager needs it
            self.tokens[request_id] = num_tokens
        return super().get_num_blocks_to_allocate(
            request_id,
            self._tokens(request_id, num_tokens),
            new_computed_blocks,
            total_computed_tokens,
            *args,
            **kwargs,
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, *args: Any, **kwargs: Any) -> list[Any]:
        return super().allocate_new_blocks(request_id, self._tokens(request_id, num_tokens), *args, **kwargs)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Once the first generated token is computed (the prompt compacted), free the prompt's blocks
        beyond the kept ones."""
        prompt = self.prompt.get(request_id)
        if prompt is None or processed_computed_tokens <= prompt:
            return
        self._remove_blocks_in_range(
            request_id, self.spec.kept_prompt_blocks(prompt), cdiv(prompt, self.block_size)
        )

    def free(self, request_id: str) -> None:
        if self.reports and request_id in self.prompt:
            prompt = self.prompt[request_id]
            steps = max(0, self.tokens.get(request_id, 0) - prompt)
            _LOG.info(
                "rlkv: request %s: %d compactions of its evicting heads (prompt %d tokens, %d decode steps)",
                request_id,
                self.compactions(request_id),
                prompt,
                steps,
            )
        self.prompt.pop(request_id, None)
        self.tokens.pop(request_id, None)
        super().free(request_id)


BACKEND_NAME = "RLKV_EVICTION"
# the platform backends the group also runs on (`eviction_stock.py`): their name -> (rlkv's backend's name, its
# class path), and the ISAs of vLLM's CPU attention whose page layout rlkv reads (checked against the stock
# cache write by the vLLM tier); on another (AMX's packed keys) the group keeps rlkv's torch form
STOCK_EVICTION_BACKENDS = {
    "CPU_ATTN": ("RLKV_EVICTION_CPU_ATTN", "rlkv.vllm_plugin.eviction_stock.CpuEvictionBackend")
}
PLAIN_CPU_ISAS = ("vec", "vec16")


def register_eviction() -> None:
    """Register `EvictionSpec` with its manager and the group's attention backends (by class path); idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_kv_cache_spec(EvictionSpec, EvictionManager)
    backends = [
        (BACKEND_NAME, "rlkv.vllm_plugin.eviction_backend.EvictionBackend"),
        *STOCK_EVICTION_BACKENDS.values(),
    ]
    for name, path in backends:
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)


def eviction_backend(platform: Any, policy: Any, head_size: int) -> type:
    """The group's backend: on the platform's kernel (`eviction_stock.py`) where rlkv has one for `platform`
    (the full heads' backend; None: `kernel: "torch"`), the policy observes no attention and the kernel's page
    layout is one rlkv reads; else rlkv's torch form."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from rlkv.vllm_plugin.eviction_backend import EvictionBackend

    entry = STOCK_EVICTION_BACKENDS.get(platform.get_name()) if platform is not None else None
    if entry is None or policy.observe_attention:
        return EvictionBackend
    config = current_vllm_config()
    isa = cpu_attention_isa(
        config.model_config.dtype, config.cache_config.block_size, head_size, config.cache_config.cache_dtype
    )
    return AttentionBackendEnum[entry[0]].get_class() if isa in PLAIN_CPU_ISAS else EvictionBackend


class EvictionAttention(Attention):
    """vLLM's decoder `Attention` over compressed KV heads whose tokens a policy evicts (`EvictionSpec`).

    policy, policy_kwargs (JSON), budget, sink, window, protect_prompt: the spec's fields; layer_index,
    head_ids: the model layer and its KV heads this module serves (a policy may depend on them, e.g.
    random eviction's hash); bucket: the spec's bucket; platform: the full heads' attention backend, whose
    kernel the group runs on where it can (`eviction_backend`; None: rlkv's torch form); other arguments as
    `Attention`'s.
    """

    def __init__(
        self,
        *args: Any,
        policy: str,
        policy_kwargs: str,
        budget: float | int,
        sink: int,
        window: int,
        protect_prompt: bool,
        layer_index: int,
        head_ids: tuple[int, ...],
        bucket: int = 0,
        platform: Any = None,
        **kwargs: Any,
    ) -> None:
        import torch

        from rlkv.policies import get_policy

        observer = get_policy(policy, **json.loads(policy_kwargs))
        super().__init__(*args, attn_backend=eviction_backend(platform, observer, args[1]), **kwargs)
        self.rlkv_rule = dict(
            policy=policy,
            policy_kwargs=policy_kwargs,
            budget=budget,
            sink=sink,
            window=window,
            protect_prompt=protect_prompt,
        )
        self.rlkv_bucket = bucket
        config = current_vllm_config()
        # what the backend's impl reads: the rule (block sizes come from the group's spec, via the builder)
        self.rlkv_spec = self.get_kv_cache_spec(config)
        self.rlkv_settings = self.rlkv_spec.settings()
        self.rlkv_policy = self.rlkv_settings.policy
        self.rlkv_rows = 2 * int(config.scheduler_config.max_num_seqs)  # the builder's table rows
        self.rlkv_layer_index = layer_index
        self.rlkv_head_ids = torch.tensor(head_ids, dtype=torch.long)

    def get_kv_cache_spec(self, vllm_config: Any) -> EvictionSpec:
        spec = super().get_kv_cache_spec(vllm_config)  # full attention's
        fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec) if f.init}
        return EvictionSpec(
            **fields,
            **self.rlkv_rule,
            max_len=vllm_config.model_config.max_model_len,
            bucket=self.rlkv_bucket,
        )
