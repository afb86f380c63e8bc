"""rlkv's compressed-head form in vLLM: sink tokens + a window, the prompt read in full, as a KV cache group.

vLLM's sliding-window spec keeps no sink tokens and windows the prompt. rlkv's own form (the one its
eval and results use) reads the whole prompt in every head, then keeps the first `sink` tokens and the
last `window` tokens (plus the current one) in each compressed head. Here that form is a KV cache spec
of its own with its own block manager and attention backend, registered through vLLM's
`KVCacheSpecRegistry` (no vLLM class patched):

- `SinkWindowSpec`: an attention spec with full attention's page and sizing, carrying `sink`, `window`
  and `full_prompt`; a type of its own (not a `FullAttentionSpec`, which vLLM would merge with the full
  heads into one group), so vLLM's hybrid manager puts these layers in groups of their own.
- `SinkWindowManager`: holds every block while the prompt is computed (chunked prefill reads earlier
  chunks), then returns to the pool every block that lies wholly between the sink and the window
  (`_remove_blocks_in_range`, the null block in their place): per request the sink's blocks and
  `ceil((window + 1) / block) + 1` window blocks at most during decode. With `full_prompt=False` the
  prompt is windowed too and the gap is freed from the first chunk on.
- `SinkWindowAttention`: vLLM's `Attention` (subclassed) whose spec is `SinkWindowSpec` and whose
  backend is `sink_window_backend.SinkWindowBackend` (token-exact masking in torch over the paged cache).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

from vllm.model_executor.layers.attention import Attention
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from rlkv.vllm_plugin.fence import register_kv_cache_spec


@dataclasses.dataclass(frozen=True, kw_only=True)
class SinkWindowSpec(AttentionSpec):
    """A full-attention page whose blocks between the sink and the window are freed once they are not read.

    sink: first tokens kept; window: past tokens kept besides the current one; full_prompt: the prompt is
    attended in full (its blocks kept until it is computed) rather than windowed; protect_prompt: the
    prompt's blocks are kept for the request's life (and its tokens attended by every later query);
    bucket: which of the split's compressed spec buckets the layer is in (`groups.plan_groups`: specs that
    differ only here are grouped apart, so that vLLM pads no full-attention group).
    """

    sink: int = 0
    window: int = 64
    full_prompt: bool = True
    protect_prompt: bool = False
    bucket: int = 0

    def max_memory_usage_bytes(self, vllm_config: Any) -> int:
        """A whole prompt may be held (as full attention): max_model_len tokens of pages."""
        return cdiv(vllm_config.model_config.max_model_len, self.block_size) * self.page_size_bytes

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, Any]) -> bool:
        return all(isinstance(s, SinkWindowSpec) and s.form == self.form for s in kv_cache_specs.values())

    @property
    def form(self) -> tuple[int, int, bool, bool]:
        return self.sink, self.window, self.full_prompt, self.protect_prompt

    def as_full_attention(self) -> FullAttentionSpec:
        """The same page as a `FullAttentionSpec` (for vLLM's full-attention prefix-cache lookup)."""
        return FullAttentionSpec(**_attention_fields(self))


def _attention_fields(spec: Any) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(AttentionSpec) if f.init}


# per block pool (one per engine): whether each cached block of a sink/window group was written as prompt (its
# KV what a cold run computes) or while its request generated; keyed by block id, set whenever a block is cached
_PROMPT_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class SinkWindowManager(FullAttentionManager):
    """Blocks of a `SinkWindowSpec` group: every block during the prompt, then the sink's and the window's."""

    def __init__(self, kv_cache_spec: SinkWindowSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink, self.window = kv_cache_spec.sink, kv_cache_spec.window
        self.full_prompt, self.protect_prompt = kv_cache_spec.full_prompt, kv_cache_spec.protect_prompt

    @classmethod
    def find_longest_cache_hit(cls, *args: Any, **kwargs: Any) -> Any:
        """Full attention's prefix lookup, cut at the first block not written as prompt: a hit needs every
        block from the first (the gap of a finished request is back in the pool, so hits end at its first
        reused block), and a block computed while its request generated (the compressed heads windowed) is
        not what a cold run computes for the same tokens as prompt (read in full)."""
        names = ("block_hashes", "max_length", "kv_cache_group_ids", "block_pool", "kv_cache_spec")
        bound = dict(zip(names, args)) | kwargs
        spec = bound["kv_cache_spec"]
        bound["kv_cache_spec"] = spec.as_full_attention()
        blocks, length = super().find_longest_cache_hit(**bound)
        roles = _PROMPT_BLOCKS.get(bound["block_pool"], {})
        exact = next((i for i, b in enumerate(blocks[0]) if not roles.get(b.block_id)), len(blocks[0]))
        if exact * spec.block_size < length:
            length = exact * spec.block_size
            for group in blocks:
                del group[exact:]
        return blocks, length

    def cache_blocks(self, request: Any, num_tokens: int, *args: Any, **kwargs: Any) -> None:
        """vLLM's caching of the request's full blocks; each block newly cached is recorded as written as prompt
        (every token of it a prompt token) or not, for `find_longest_cache_hit`."""
        before = self.num_cached_block.get(request.request_id, 0)
        super().cache_blocks(request, num_tokens, *args, **kwargs)
        after = self.num_cached_block.get(request.request_id, 0)
        blocks = self.req_to_blocks[request.request_id]
        roles = _PROMPT_BLOCKS.setdefault(self.block_pool, {})
        prompt_blocks = request.num_prompt_tokens // self.block_size
        for i in range(before, after):
            roles[blocks[i].block_id] = i < prompt_blocks

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Free the blocks no later query reads: those wholly in [sink (or the prompt's end when protected),
        next position - window)."""
        if self.full_prompt and (num_prompt_tokens is None or processed_computed_tokens < num_prompt_tokens):
            return  # a later prompt chunk attends every earlier prompt token
        kept = max(self.sink, num_prompt_tokens or 0) if self.protect_prompt else self.sink
        first = cdiv(kept, self.block_size)
        # the next query is at position `processed_computed_tokens` and reads from there minus the window
        last = max(0, processed_computed_tokens - self.window) // self.block_size
        self._remove_blocks_in_range(request_id, first, last)


BACKEND_NAME = "RLKV_SINK_WINDOW"


def register_sink_window() -> None:
    """Register `SinkWindowSpec` with its manager (vLLM's KV cache spec registry) and the group's attention
    backend (vLLM's backend registry, by class path: nothing imported until a layer uses it); idempotent."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_kv_cache_spec(SinkWindowSpec, SinkWindowManager)
    if BACKEND_NAME not in AttentionBackendEnum.__members__:
        register_backend(BACKEND_NAME, "rlkv.vllm_plugin.sink_window_backend.SinkWindowBackend")


class SinkWindowAttention(Attention):
    """vLLM's decoder `Attention` over compressed KV heads in rlkv's sink + window form.

    sink, window: tokens kept (besides the current one); full_prompt: the prompt is read in full;
    protect_prompt: and kept whole; bucket: the spec's bucket; backend: the attention backend (rlkv's
    gather form, `sink_window_backend.SinkWindowBackend`, by default). Other arguments as `Attention`'s
    (no sliding window: the form is the spec's and the backend's).
    """

    spec_class: type[SinkWindowSpec] = SinkWindowSpec

    def __init__(
        self,
        *args: Any,
        sink: int,
        window: int,
        full_prompt: bool,
        protect_prompt: bool = False,
        bucket: int = 0,
        backend: type | None = None,
        **kwargs: Any,
    ) -> None:
        if backend is None:
            from rlkv.vllm_plugin.sink_window_backend import SinkWindowBackend

            backend = SinkWindowBackend
        super().__init__(*args, attn_backend=backend, **kwargs)
        self.rlkv_sink, self.rlkv_window, self.rlkv_full_prompt = sink, window, full_prompt
        self.rlkv_protect_prompt, self.rlkv_bucket = protect_prompt, bucket

    def get_kv_cache_spec(self, vllm_config: Any) -> SinkWindowSpec:
        spec = super().get_kv_cache_spec(vllm_config)  # full attention's (no sliding window)
        return self.spec_class(
            **_attention_fields(spec),
            sink=self.rlkv_sink,
            window=self.rlkv_window,
            full_prompt=self.rlkv_full_prompt,
            protect_prompt=self.rlkv_protect_prompt,
            bucket=self.rlkv_bucket,
        )
