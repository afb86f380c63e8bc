"""`StaticHeadMixedCache`: the head-mixed cache with static shapes and fixed addresses.

Same layout idea as `HeadMixedCache` (rlkv/cache/layer.py): per layer, the KV heads marked full
keep every token and the others keep a policy-bounded set. Here every tensor is preallocated
once and written in place, so a decode step has one shape and one set of addresses and
`torch.compile(fullgraph=True, dynamic=False)` / CUDA graphs can capture it:

- full heads: `[B, H_full, max_cache_len, D]`, token t written at column t (`index_copy_`);
- compressed heads: `[B, H_c, early + region, D]` slots with int32 positions (-1 = empty). The
  early region holds each row's protected prompt and sink, shifted so a row's first real token
  sits at the same slot; the region is a ring of window + 1 slots (streaming) or a budget +
  slack region compacted in place between decode steps (rlkv/cache/static/budget.py).

Prefill runs eagerly (one SDPA over the prompt, as the dynamic cache attends before it evicts);
a decode step is device ops only: every index comes from a device counter, never from the host.
Host bookkeeping (tokens stored, when a compaction is due) runs before each forward, from
`update` in eager mode or from the hook `install_step_hook` puts on `prepare_inputs_for_generation`
(transformers' compiled decode never runs `update` in Python). A policy that observes token ids or
final hidden states (SkipKV) gets them there too, after the due compaction, as the dynamic cache
compacted within the last forward: the forward's token ids, and the last forward's final-norm hidden
state, which the model's observer hook copies into a fixed buffer (`stash_hidden`). See docs/design.md.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rlkv.cache.layer import PolicyCache, full_head_layout
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.static.budget import StaticCacheError, static_form
from rlkv.cache.static.layer import StaticHeadMixedLayer
from rlkv.cache.static.slots import kept_per_head
from rlkv.cache.stats import CacheStats
from rlkv.compat import forward_cache, mark_static_address
from rlkv.geometry import attention_geometry
from rlkv.policies.base import CompressionPolicy


class StaticHeadMixedCache(PolicyCache):
    """A head-mixed KV cache with static shapes (see the module docstring), built by
    `rlkv.inference.make_cache(model, config, static=True, max_cache_len=...)`.

    max_cache_len: prompt columns + tokens to generate; full heads hold that many columns.
    max_prompt_len: the widest prompt expected (None: the first one). Where the compressed heads keep
    the prompt (a protected prompt, the budget policies' early region), their tensors are sized for it
    at the first request, so a later, wider prompt up to it keeps the shapes and addresses (a compiled
    decode keeps its graph) instead of reallocating.
    Raises `StaticCacheError` for a layout without a static form (the message names
    `static_cache=False`), a prompt or a generation longer than max_cache_len, or chunked prefill.
    """

    def __init__(
        self,
        config: Any,
        full_heads: torch.Tensor | None,
        policy: CompressionPolicy,
        *,
        max_cache_len: int,
        sink: int = 16,
        window: int = 64,
        budget: int | float | None = None,
        protect_prompt: bool = True,
        batch_size: int | None = None,
        max_prompt_len: int | None = None,
    ) -> None:
        geometry = attention_geometry(config)
        full_heads = full_head_layout(config, full_heads)
        if int(max_cache_len) < 1:
            raise StaticCacheError(f"max_cache_len={max_cache_len} must be >= 1 (prompt + max_new_tokens)")
        self.settings = CompressionSettings(policy, sink, window, budget, protect_prompt)
        self.form = static_form(self.settings, bool((~full_heads).any()), int(max_cache_len))
        self.full_heads, self._max_cache_len, self.expected_batch_size = (
            full_heads,
            int(max_cache_len),
            batch_size,
        )
        compressed = (~full_heads).any(dim=1).nonzero().flatten().tolist()
        shared = {"owner": compressed[0] if compressed else None}
        layers = [
            StaticHeadMixedLayer(
                i,
                full_heads[i],
                geometry.num_groups,
                self.settings,
                self.form,
                max_cache_len,
                max_prompt_len or 0,
                shared,
            )
            for i in range(geometry.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.hidden_stash: torch.Tensor | None = None  # the last forward's final hidden state [B, 1, hidden]
        policy.reset()

    @property
    def max_cache_len(self) -> int:
        """Columns of the full heads (prompt + tokens to generate). A property because transformers
        before 5.20 declares a read-only (deprecated) `Cache.max_cache_len` that an attribute cannot shadow."""
        return self._max_cache_len

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write a layer's new key/value states in place; returns the layer for its `attend`."""
        if self.expected_batch_size is not None and key_states.shape[0] != self.expected_batch_size:
            raise ValueError(
                f"this cache was made for batch_size={self.expected_batch_size}, got {key_states.shape[0]}; "
                "make_cache(model, config, batch_size=None) accepts any batch size"
            )
        return self.layers[layer_idx].update(key_states, value_states)

    @property
    def begun(self) -> bool:
        """Whether the next forward's host bookkeeping already ran (`before_forward`)."""
        return self.layers[0].begun

    def before_forward(self, q_len: int, token_ids: torch.Tensor | None = None) -> None:
        """Host bookkeeping for the next forward of `q_len` tokens (eager: the step hook calls it in
        `generate`, the observer hooks in a direct forward): checks and a due compaction per layer, then,
        for an observing policy, the last forward's hidden state and this forward's `token_ids` [B, Q]."""
        start = self.layers[0].host_length
        for layer in self.layers:
            layer.begin(q_len)
            layer.begun = True
        policy = self.settings.policy
        if not (policy.observe_tokens or policy.observe_hidden_states):
            return
        if not start:
            policy.reserve(self.max_cache_len - q_len)
        elif policy.observe_hidden_states and self.hidden_stash is not None:
            device = self.hidden_stash.device
            policy.on_hidden_states(self.hidden_stash, torch.arange(start - 1, start, device=device))
        if policy.observe_tokens:
            if token_ids is None:
                raise StaticCacheError(
                    f"policy {policy.name!r} observes token ids: call the model with input_ids, not inputs_embeds"
                )
            policy.on_tokens(token_ids, torch.arange(start, start + q_len, device=token_ids.device))

    def stash_hidden(self, hidden_states: torch.Tensor) -> None:
        """Keep the last column of a forward's final-norm hidden states [B, Q, hidden] in a fixed buffer
        (a compiled step: one copy into a static address), observed before the next forward."""
        last = hidden_states[:, -1:].detach()
        stash = self.hidden_stash
        if (
            stash is None
            or stash.shape != last.shape
            or stash.dtype != last.dtype
            or stash.device != last.device
        ):
            if torch.compiler.is_compiling():
                raise StaticCacheError("the hidden-state buffer was first needed inside a compiled step")
            with torch.inference_mode(False):
                self.hidden_stash = stash = torch.empty_like(last)
            mark_static_address(stash)
        stash.copy_(last)

    def resident_bytes(self) -> int:
        """Bytes the cache, its policy and the hidden-state buffer of an observing policy hold."""
        stash = (
            0 if self.hidden_stash is None else self.hidden_stash.numel() * self.hidden_stash.element_size()
        )
        return super().resident_bytes() + stash

    def after_forward(self) -> None:
        """The last forward's tokens are written (a compiled forward never returns to `update` in Python)."""
        for layer in self.layers:
            layer.in_flight = 0

    def stats_snapshot(self) -> int:
        """What `stats(at=...)` needs of this moment, read on the host only: the tokens seen."""
        return self.layers[0].host_length

    def stats(self, at: int | None = None) -> list[CacheStats]:
        """One `CacheStats` per batch row, at `stats_snapshot()` `at` (None: now). Token counts follow
        from the host-known layout; the row starts are read from the device (call between steps)."""
        layer0 = self.layers[0]
        length = layer0.host_length if at is None else at
        if not length:
            return []
        batch = layer0.batch
        head_dim = next(t for n, t in layer0.buffers.items() if n.endswith("_k")).shape[-1]
        element = torch.finfo(layer0.dtype).bits // 8
        # what a DynamicCache holds for the batch (padding columns included), shared by the rows as resident is
        full = 2 * batch * len(self.layers) * layer0.num_kv_heads * length * head_dim * element
        starts = layer0.buffers["row_start"].tolist()
        kept, evicted = [0] * batch, [0] * batch
        for layer in self.layers:
            h_full, h_comp = layer.full_idx.numel(), layer.comp_idx.numel()
            for row, start in enumerate(starts):
                comp = kept_per_head(layer, length, row, start) if h_comp else 0
                kept[row] += h_full * (length - start) + h_comp * comp
                evicted[row] += h_comp * (length - start - comp)
        resident = self.resident_bytes() // batch
        return [
            CacheStats(resident, full // batch, length - starts[row], kept[row], evicted[row])
            for row in range(batch)
        ]


def install_step_hook(model: torch.nn.Module) -> None:
    """Make `model.generate` run a `StaticHeadMixedCache`'s host bookkeeping before each forward
    (idempotent): wraps the instance's `prepare_inputs_for_generation`, which transformers calls
    eagerly once per forward, also when it compiles the decode step."""
    if getattr(model, "_rlkv_static_step_hook", False):
        return
    original = model.prepare_inputs_for_generation

    @functools.wraps(original)
    def prepare_inputs_for_generation(*args: Any, **kwargs: Any) -> Any:
        cache = forward_cache(kwargs)
        if isinstance(cache, StaticHeadMixedCache):
            cache.after_forward()  # before transformers sizes the next mask from get_seq_length()
        inputs = original(*args, **kwargs)
        cache = forward_cache(inputs)
        if isinstance(cache, StaticHeadMixedCache):
            tokens = inputs.get("input_ids")
            q_len = (tokens if tokens is not None else inputs["inputs_embeds"]).shape[1]
            cache.before_forward(q_len, tokens)
        return inputs

    model.prepare_inputs_for_generation = prepare_inputs_for_generation
    model._rlkv_static_step_hook = True
