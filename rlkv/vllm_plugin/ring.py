"""rlkv's eval form (sink + window, the prompt read in full) on the platform's own attention kernel: a ring.

Each request of the group holds, for its whole life, `ring_blocks` blocks at the front of its block table
(its ring: `sink + window + 1` slots, `RingSpec.ring_slot`) and, while it computes its prompt, the prompt's
blocks after them (position p at block `ring_blocks + p // block`, slot `p % block`). Every token is
written to the ring (a token a later token of the same step overwrites is skipped, so one write per slot),
and a prompt token also to its prompt slot. A prompt query reads the prompt's blocks (the stock kernel,
causal, the whole prompt: rlkv's full-prompt form); a generated query at position p reads the ring's
first `min(p + 1, sink + window + 1)` slots, which hold exactly positions [0, sink) and [p - window, p]:
softmax ignores the slots' order and keys carry their RoPE, so one stock paged call reads them. Once the
prompt is computed its blocks go back to the pool: a request generating holds `ring_blocks` blocks
(`ceil((sink + window + 1) / block)`), against up to `ceil((window + 1) / block) + 1` window blocks plus
the sink's for the gather form (`sink_window.py`), which stays the exact reference (`kernel: "torch"`).

The protected form (`protect_prompt`: the prompt kept for the request's life) lays the ring after the prompt
instead: a request's table is linear from its first block, position p < base at slot p and a later one at
`base + (p - base) % (window + 1)`, where base = max(the prompt's end, sink); a generated query reads the
table's first `min(p + 1, base + window + 1)` slots, i.e. the prompt (sink included) and its window, in one
stock call; a request holds `ceil((base + window + 1) / block)` blocks at most.

The ring's blocks are a request's own and hold positions out of order, so this group caches no block for
prefix hits (vLLM then finds none for the model: tokens stay those of a cold run).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager

from rlkv.vllm_plugin.fence import register_kv_cache_spec
from rlkv.vllm_plugin.sink_window import SinkWindowAttention, SinkWindowSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingSpec(SinkWindowSpec):
    """`SinkWindowSpec` of the ring layout: `ring_blocks` blocks of ring, then the prompt's blocks."""

    @property
    def ring_capacity(self) -> int:
        """Slots a request's ring reads: `sink + window + 1`."""
        return self.sink + self.window + 1

    @property
    def ring_blocks(self) -> int:
        """Blocks at the front of each request's table that hold its ring (none in the protected layout)."""
        return 0 if self.protect_prompt else cdiv(self.ring_capacity, self.block_size)

    def max_num_blocks_per_req(self, vllm_config: Any, max_len: int) -> int:
        """The prompt's blocks (at most `max_len` tokens) after the ring's."""
        return self.ring_blocks + cdiv(max_len, self.block_size)

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        return self.max_num_blocks_per_req(vllm_config, vllm_config.model_config.max_model_len) * (
            self.page_size_bytes
        )


class RingManager(FullAttentionManager):
    """Blocks of a `RingSpec` group: the ring's from the first allocation, the prompt's until it is computed.

    vLLM's managers count blocks from a token count; this one asks its base for `ring_blocks` blocks more than
    the tokens of the request's prefill need (`prefill_end`: the prompt, or with a resumed request the tokens
    it replays) and never more: a generated token lives in the ring.
    """

    def __init__(self, kv_cache_spec: RingSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.ring_tokens = kv_cache_spec.ring_blocks * kv_cache_spec.block_size
        # the protected layout: a request holds at most base + window + 1 slots (base: its prompt's end, or sink)
        self.protect, self.sink, self.window = (
            kv_cache_spec.protect_prompt,
            kv_cache_spec.sink,
            kv_cache_spec.window,
        )
        # request -> the tokens its prefill computes (vLLM's prefill_end, or a replayed row's end)
        self.prefill_end: dict[str, int] = {}

    def _slot_tokens(self, request_id: str, num_tokens: int) -> int:
        """Token slots of the base manager's count that hold `num_tokens` of this request."""
        prefill_end = self.prefill_end.get(request_id, num_tokens)
        if self.protect:
            return min(num_tokens, max(prefill_end, self.sink) + self.window + 1)
        return self.ring_tokens + min(num_tokens, prefill_end)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Any,
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        if (
            total_computed_tokens < prefill_end
        ):  # a prompt, or one replayed with its outputs after a preemption
            # vLLM's prefill_end of a replay stops one token short of what the step computes (its last output
            # counts as decode), but the backend reads every query of a replayed row over the prompt's blocks
            self.prefill_end[request_id] = max(prefill_end, num_tokens)
        return super().get_num_blocks_to_allocate(
            request_id,
            self._slot_tokens(request_id, num_tokens),
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            self._slot_tokens(request_id, num_tokens_main_model),
            apply_admission_cap=apply_admission_cap,
            prefill_end=prefill_end,
        )

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int) -> Any:
        main = self._slot_tokens(request_id, num_tokens_main_model)
        return super().allocate_new_blocks(request_id, self._slot_tokens(request_id, num_tokens), main)

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Return the prompt's blocks to the pool once every prefill token is computed (no query reads them);
        the protected layout keeps them."""
        if self.protect:
            return
        end = max(self.prefill_end.get(request_id, 0), num_prompt_tokens or 0)
        blocks = self.req_to_blocks.get(request_id)
        if blocks and end and processed_computed_tokens >= end:
            self._remove_blocks_in_range(request_id, self.ring_tokens // self.block_size, len(blocks))

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self.prefill_end.pop(request_id, None)

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any) -> Any:
        """No hit: a ring holds positions out of order, and a prompt block sits after the ring."""
        names = ("block_hashes", "max_length", "kv_cache_group_ids")
        group_ids = dict(zip(names, args)).get("kv_cache_group_ids", kwargs.get("kv_cache_group_ids"))
        return tuple([] for _ in group_ids), 0

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        return  # nothing of this group is reusable by another request (`find_longest_cache_hit`)


# the platform backends the ring runs on: their name -> (rlkv's backend's name, its class path)
RING_BACKENDS = {"CPU_ATTN": ("RLKV_RING_CPU_ATTN", "rlkv.vllm_plugin.ring_backend.CpuRingBackend")}


def register_ring() -> None:
    """Register `RingSpec` with its manager (vLLM's KV cache spec registry) and the group's backend; idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_kv_cache_spec(RingSpec, RingManager)
    for name, path in RING_BACKENDS.values():
        if name not in AttentionBackendEnum.__members__:
            register_backend(name, path)


def ring_backend(platform_backend: Any) -> type | None:
    """rlkv's ring backend over the platform backend the full heads use, or None where there is none yet."""
    entry = RING_BACKENDS.get(platform_backend.get_name())
    if entry is None:
        return None
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    return AttentionBackendEnum[entry[0]].get_class()


class RingAttention(SinkWindowAttention):
    """`SinkWindowAttention` in the ring layout (`RingSpec`), on a ring backend (`ring_backend`)."""

    spec_class = RingSpec
