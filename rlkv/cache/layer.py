"""`HeadMixedCache`: a transformers `Cache` whose layers keep full KV only for the heads that need it.

Per layer (`HeadMixedLayer`), the KV heads marked full (a row of `HeadMask.full_heads(sparsity)`)
store every token as `[B, H_full, T, D]`; the other heads live in a `CompressedStore`
(rlkv/cache/store.py) that a compression policy keeps bounded. `update()` returns the layer itself
instead of key/value tensors; the "rlkv_cache" attention function (rlkv/cache/attention.py,
activated by `rlkv.inference.make_cache`) attends over the split storage and then lets the policy
compress. This is safe for Llama, Qwen2, Qwen3 and Mistral in transformers 5.x, whose attention
modules pass key/value from `update()` straight to the attention function. See docs/design.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from rlkv.cache.growth import append_along_tokens, grows_in_place, token_prefix
from rlkv.cache.head_index import head_indices, pick_heads
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.stats import CacheStats, head_mixed_counts, head_mixed_stats
from rlkv.cache.store import CompressedStore, storage_bytes
from rlkv.geometry import attention_geometry
from rlkv.policies.base import CompressionPolicy


class StaleCacheError(RuntimeError):
    """A new prefill reached a cache that still holds a previous request (it was not reset)."""


class HeadMixedLayer(CacheLayerMixin):
    """One layer of a `HeadMixedCache`: full heads `[B, H_full, T, D]` + a `CompressedStore`."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(
        self, layer_idx: int, full_heads: torch.Tensor, num_groups: int, settings: CompressionSettings
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_kv_heads = int(full_heads.numel())
        self.num_groups = int(num_groups)
        self.settings = settings
        self.full_idx, self.full_slice = head_indices(full_heads)
        self.comp_idx, self.comp_slice = head_indices(~full_heads)
        self.has_full = bool(full_heads.any())  # host flags: a decode step asks, and reads no tensor
        self.full_q, self.full_q_slice = head_indices(full_heads, self.num_groups)
        self.comp_q, self.comp_q_slice = head_indices(~full_heads, self.num_groups)
        self.store = (
            CompressedStore(layer_idx, self.comp_idx, self.num_groups, settings)
            if self.comp_idx.numel()
            else None
        )
        self.logical_length = 0
        self.decoding = False  # a single-token step has run: a multi-token forward now is a new request
        self.row_start: torch.Tensor | None = None  # LongTensor[B]: first real column of each row
        self.row_start_host: list[int] | None = None  # the same as Python ints (read once per prompt)
        self._key_storage: torch.Tensor | None = None  # what `keys` / `values` are prefix views of
        self._value_storage: torch.Tensor | None = None

    # CacheLayerMixin -----------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.full_idx = self.full_idx.to(self.device)
        self.comp_idx = self.comp_idx.to(self.device)
        if self.store is not None:
            self.store.head_idx = self.comp_idx
        self.full_q = self.full_q.to(self.device)
        self.comp_q = self.comp_q.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store the new tokens' key/value [B, H_kv, Q, D]; returns (self, self) for the attention function."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first = self.logical_length == 0
        if self.has_full:
            k_full = pick_heads(key_states, self.full_idx, self.full_slice)
            v_full = pick_heads(value_states, self.full_idx, self.full_slice)
            if first:
                self._key_storage = self._value_storage = self.keys = self.values = None
            # keys/values are prefix views of storages with spare capacity: no O(T) copy per step
            in_place = grows_in_place(self.keys)
            self._key_storage = append_along_tokens(self._key_storage, self.keys, k_full, in_place)
            self._value_storage = append_along_tokens(self._value_storage, self.values, v_full, in_place)
            length = self.logical_length + key_states.shape[2]
            self.keys = token_prefix(self._key_storage, length)
            self.values = token_prefix(self._value_storage, length)
        if self.store is not None:
            k_comp = pick_heads(key_states, self.comp_idx, self.comp_slice)
            v_comp = pick_heads(value_states, self.comp_idx, self.comp_slice)
            # the prompt = every token before the first single-token step (chunked prefill included)
            prefill = first or (key_states.shape[2] > 1 and self.store.prompt_length == self.logical_length)
            if prefill:
                self.store.prompt_length = self.logical_length + key_states.shape[2]
            self.store.is_prefill = prefill
            self.store.append(k_comp.contiguous(), v_comp.contiguous())
        self.logical_length += key_states.shape[2]
        self.decoding = self.decoding or key_states.shape[2] == 1
        return self, self

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.logical_length + query_length, 0

    def get_seq_length(self) -> int:
        return self.logical_length

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.keys = self.values = self._key_storage = self._value_storage = None
        self.logical_length = 0
        self.decoding = False
        self.row_start = None
        self.row_start_host = None
        if self.store is not None:
            self.store.clear()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("HeadMixedCache does not support beam search; use greedy or sampling")

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("HeadMixedCache cannot be cropped: evicted tokens are gone")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError(
            "HeadMixedCache does not support num_return_sequences > 1; repeat the prompts"
        )

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("HeadMixedCache does not support selecting batch rows")

    # accounting ------------------------------------------------------------------------------
    def tensors(self) -> list[torch.Tensor | None]:
        extra = self.store.tensors() if self.store is not None else []
        indices = [self.full_idx, self.comp_idx, getattr(self, "full_q", None), getattr(self, "comp_q", None)]
        return [self.keys, self.values, *extra, self.row_start, *indices]


def full_head_layout(config: Any, full_heads: torch.Tensor | None) -> torch.Tensor:
    """`full_heads` as a CPU BoolTensor[L, H_kv] checked against the model's geometry (None: every head
    compressed); ValueError naming both shapes otherwise."""
    geometry = attention_geometry(config)
    shape = (geometry.num_hidden_layers, geometry.num_key_value_heads)
    if full_heads is None:
        return torch.zeros(shape, dtype=torch.bool)
    full_heads = torch.as_tensor(full_heads, dtype=torch.bool).cpu()
    if tuple(full_heads.shape) != shape:
        raise ValueError(
            f"full_heads has shape {tuple(full_heads.shape)}; the model needs (num_hidden_layers, "
            f"num_key_value_heads) = {shape}"
        )
    return full_heads


class PolicyCache(Cache):
    """What the dynamic (`HeadMixedCache`) and static (`StaticHeadMixedCache`) head-mixed caches share:
    one policy and budget (`settings`), a full-head layout `full_heads` BoolTensor[L, H_kv], the reset
    at each new request, and resident bytes read from storage. Subclasses set `settings` and
    `full_heads`, and their layers implement `reset()` and `tensors()`."""

    settings: CompressionSettings
    full_heads: torch.Tensor

    @property
    def policy(self) -> CompressionPolicy:
        return self.settings.policy

    # `generate` marks a cache passed by the user with this attribute at the start of every call:
    # that is where a new request begins, before generate reads get_seq_length() to slice the prompt.
    @property
    def _is_user_defined(self) -> bool:
        return True

    @_is_user_defined.setter
    def _is_user_defined(self, value: bool) -> None:
        self.reset()

    def reset(self) -> None:
        """Drop all stored tokens and per-sequence state (the next forward is a new prefill)."""
        for layer in self.layers:
            layer.reset()
        self.settings.policy.reset()

    def resident_bytes(self) -> int:
        """Bytes of every tensor the cache and its policy hold (KV, positions, bookkeeping), read from
        storage: for the static cache, its allocated capacity."""
        layers = (t for layer in self.layers for t in layer.tensors())
        return storage_bytes([self.full_heads, *layers, *self.settings.policy.state_tensors()])


class HeadMixedCache(PolicyCache):
    """A KV cache keeping full history for the heads marked full and a policy-bounded store for the rest.

    Build it with `rlkv.inference.make_cache(model, CompressionConfig(...))`, which also switches the
    model to the "rlkv_cache" attention function; or directly with the model's config, a full-head
    layout `full_heads` BoolTensor[L, H_kv] (None = every head compressed) and a policy instance.
    `batch_size`, if given, is checked at every update (a clear error instead of a shape mismatch).
    Each `model.generate(**cache_kwargs(cache))` call starts from an empty cache (transformers marks
    the cache `_is_user_defined`, which resets it); a multi-token forward once decoding has started
    raises `StaleCacheError` instead of attending to the previous request: call `reset()` first.
    """

    def __init__(
        self,
        config: Any,
        full_heads: torch.Tensor | None,
        policy: CompressionPolicy,
        *,
        sink: int = 16,
        window: int = 64,
        budget: int | float | None = None,
        protect_prompt: bool = True,
        batch_size: int | None = None,
        window_prefill: bool = False,
    ) -> None:
        geometry = attention_geometry(config)
        num_layers = geometry.num_hidden_layers
        full_heads = full_head_layout(config, full_heads)
        self.settings = CompressionSettings(policy, sink, window, budget, protect_prompt, window_prefill)
        self.full_heads = full_heads
        layers = [
            HeadMixedLayer(i, full_heads[i], geometry.num_groups, self.settings) for i in range(num_layers)
        ]
        super().__init__(layers=layers)
        self.expected_batch_size = batch_size
        policy.reset()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Store a layer's new key/value states; returns the layer for the rlkv_cache attention function."""
        if self.expected_batch_size is not None and key_states.shape[0] != self.expected_batch_size:
            raise ValueError(
                f"this HeadMixedCache was made for batch_size={self.expected_batch_size}, got a batch of "
                f"{key_states.shape[0]}; make_cache(model, config, batch_size=None) accepts any batch size"
            )
        layer = self.layers[layer_idx]
        if key_states.shape[2] > 1 and layer.decoding:
            raise StaleCacheError(
                f"HeadMixedCache got a {key_states.shape[2]}-token forward after decoding had started "
                f"({layer.logical_length} tokens stored): a new request on a cache that still holds the last "
                "one. Call cache.reset() before reusing it (transformers' generate resets it through "
                "`cache._is_user_defined`; a transformers version that no longer does is not supported)"
            )
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def logical_length(self) -> int:
        """Deprecated (removed in rlkv 0.3): `get_seq_length()`, the tokens seen so far (padding included)."""
        warnings.warn(
            "HeadMixedCache.logical_length() is deprecated and will be removed in rlkv 0.3; use "
            "cache.get_seq_length() (the same number: tokens seen so far, padding columns included)",
            FutureWarning,
            stacklevel=2,
        )
        return self.get_seq_length()

    def full_resident_bytes(self) -> int:
        """Bytes a full (DynamicCache) KV cache would hold for the same batch and length."""
        total = 0
        for layer in self.layers:
            stored = layer.keys if layer.keys is not None else (layer.store.keys if layer.store else None)
            if stored is None:
                continue
            batch, _, _, head_dim = stored.shape
            total += 2 * batch * layer.num_kv_heads * layer.logical_length * head_dim * stored.element_size()
        return total

    def stats_snapshot(self) -> tuple:
        """What `stats(at=...)` needs of this moment, host counts only (no device read, O(layers))."""
        return head_mixed_counts(self)

    def stats(self, at: tuple | None = None) -> list[CacheStats]:
        """One `CacheStats` per batch row: resident_bytes (share of the batched storage, now),
        full_resident_bytes, logical_length (real tokens seen), kept_tokens (KV entries kept over
        layers and KV heads), evictions (KV entries evicted over layers and KV heads); at a
        `stats_snapshot()` `at` (None: now)."""
        return head_mixed_stats(self, at)
