"""Sampling GRPO rollouts with a compressed (or stock) KV cache, and what they hold in memory.

`RolloutGenerator` samples completions for left-padded prompt ids the way TRL's transformers path
does (`model.generate` with the trainer's `GenerationConfig`) and records, per sampled token, its
log-probability under the attention that sampled it. A static cache (`StaticHeadMixedCache`, the
default on CUDA for layouts that have one) is kept from one call to the next: its tensors and the
recorder's keep their addresses, so transformers' compiled decode (CUDA graphs) replays. Nothing in a
decode step reads the device (finished rows are read every few steps, `host_row_ends`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, StoppingCriteriaList

from rlkv.cache import CacheStats, HeadMixedCache, StaticHeadMixedCache, register_attention, storage_bytes
from rlkv.compat import cache_kwargs, mark_static_address
from rlkv.inference import CompressionConfig
from rlkv.inference.api import decode_compile_config, make_decode_cache
from rlkv.inference.row_ends import host_row_ends

# A static rollout cache holds its prompt width + max_new_tokens rounded up to this many columns, so
# prompts of nearby widths reuse one cache (one compiled graph) instead of each making a new one.
STATIC_CACHE_COLUMNS = 64


@dataclasses.dataclass
class RolloutBatch:
    """Completions of one rollout call.

    completion_ids[i]: generated tokens of row i up to and including its first EOS (TRL's rule);
    logprobs[i]: log-softmax(raw logits / temperature) of those tokens; kv: memory stats.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    kv: CacheStats


class SampledLogprobRecorder:
    """Forward hook recording log p(sampled token) under `logits / temperature`, one [B] column per forward.

    It reads the model's raw last-position logits (before generate's logits processors and
    warpers: what TRL's loss evaluates); the token sampled after forward t arrives as the
    `input_ids` of forward t + 1 (the last one in `finish`). Its tensors (the last forward's
    log-probs [B, vocab], the columns [B, max_new_tokens + 1] and a device step counter) are written
    in place and kept while B, vocab and the column count stay the same, so the hook traces into a
    compiled decode step (no host value, no new tensor) and CUDA graphs replay on them.
    """

    def __init__(self) -> None:
        self.temperature, self.num_columns = 1.0, 0
        self.pending: torch.Tensor | None = None  # FloatTensor [B, vocab]: last forward's log-probs
        self.columns: torch.Tensor | None = None  # FloatTensor [B, C]: column t + 1 = token t
        self.step: torch.Tensor | None = None  # LongTensor []: forwards run in this request

    def start(self, max_new_tokens: int, temperature: float) -> None:
        """Begin a request of at most `max_new_tokens` sampled tokens (call before `generate`)."""
        self.num_columns, self.temperature = max_new_tokens + 1, float(temperature)
        if self.step is not None:
            self.step.zero_()

    def _allocate(self, logits: torch.Tensor) -> None:
        batch, vocab = logits.shape[0], logits.shape[-1]
        shape = (batch, self.num_columns)
        kept = self.columns is not None and self.columns.device == logits.device
        if kept and self.columns.shape == shape and self.pending.shape == (batch, vocab):
            return
        with torch.inference_mode(False):  # normal tensors: later requests may run outside inference mode
            self.pending = logits.new_zeros((batch, vocab), dtype=torch.float32)
            self.columns = logits.new_zeros(shape, dtype=torch.float32)
            self.step = torch.zeros((), dtype=torch.long, device=logits.device)
        for t in (self.pending, self.columns, self.step):
            mark_static_address(t)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        logits = output.logits[:, -1]
        if not torch.compiler.is_compiling():  # transformers compiles decode steps only: the prefill is here
            self._allocate(logits)
        # forward 0 writes column 0 from the previous request's log-probs: never read
        self.columns.index_copy_(1, self.step.view(1), self.pending.gather(1, input_ids[:, -1:]))
        self.pending.copy_(torch.log_softmax(logits.float() / self.temperature, dim=-1))
        self.step.add_(1)

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """FloatTensor [B, N] for the N generated tokens `completion_ids` [B, N] (a copy)."""
        num = completion_ids.shape[1]
        if num == 0 or self.columns is None:
            return torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        last = self.pending.gather(1, completion_ids[:, num - 1 : num])  # never fed back to the model
        return torch.cat([self.columns[:, 1:num], last], dim=1)


def kv_storage_bytes(cache: Any) -> int:
    """Bytes held by a KV cache's tensors, read from their storage (a head-mixed cache or a stock Cache)."""
    if isinstance(cache, (HeadMixedCache, StaticHeadMixedCache)):
        return cache.resident_bytes()
    return storage_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])


@contextlib.contextmanager
def track_peak_kv_bytes(model: torch.nn.Module, cache: Any) -> Iterator[list[int]]:
    """Context: yields a one-element list holding the largest `kv_storage_bytes(cache)` after any forward.

    A static cache's storage never changes size (it is allocated at the prefill): no hook then, the
    peak is what it holds at the end (a hook reading storage sizes would not trace into a compiled step).
    """
    peak = [0]
    if isinstance(cache, StaticHeadMixedCache):
        yield peak
        return

    def after_forward(module, args, output):
        peak[0] = max(peak[0], kv_storage_bytes(cache))

    handle = model.register_forward_hook(after_forward)
    try:
        yield peak
    finally:
        handle.remove()


def transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers `PreTrainedModel` inside a PEFT wrapper (or `model` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@contextlib.contextmanager
def rollout_mode(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode during generation; restores train mode and the attention implementation afterwards."""
    base = transformers_model(model)
    attention = base.config._attn_implementation
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        if base.config._attn_implementation != attention:
            base.set_attn_implementation(attention)
        model.train(was_training)


def first_eos_lengths(completion_ids: torch.Tensor, eos_token_ids: list[int]) -> torch.Tensor:
    """LongTensor [B]: tokens kept per row = up to and including the first EOS (all if none)."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    lengths = torch.full((completion_ids.shape[0],), completion_ids.shape[1], device=completion_ids.device)
    has_eos = is_eos.any(dim=1)
    lengths[has_eos] = is_eos.int().argmax(dim=1)[has_eos] + 1
    return lengths


class RolloutGenerator:
    """Samples rollouts with a compressed KV cache laid out by `compression` (None: a stock
    `DynamicCache` under the model's own attention, the full-cache reference).

    static_cache: None (default) uses a `StaticHeadMixedCache` on CUDA when the layout has a static
    form, decoded by transformers' compiled step (`fullgraph=True, dynamic=False`, CUDA graphs), and
    the dynamic `HeadMixedCache` otherwise; True uses the static cache on any device (eager off CUDA)
    and raises `StaticCacheError` for a layout without a static form; False always the dynamic one.
    The static cache holds prompt width + max_new_tokens rounded up to STATIC_CACHE_COLUMNS columns
    and is reused while a request fits it.
    compile_config: transformers `CompileConfig` for the decode step of a static cache (None: CUDA
    graphs on CUDA, eager elsewhere; `rlkv.inference.api.decode_compile_config`).
    """

    def __init__(
        self,
        compression: CompressionConfig | None,
        static_cache: bool | None = None,
        compile_config: Any = None,
    ) -> None:
        self.compression, self.static_cache, self.compile_config = compression, static_cache, compile_config
        self._static: StaticHeadMixedCache | None = None
        self._recorder = SampledLogprobRecorder()

    @property
    def kept_static_cache(self) -> StaticHeadMixedCache | None:
        """The static cache the last rollout ran on, kept for the next (None: the dynamic cache ran)."""
        return self._static

    def _cache(self, base: torch.nn.Module, columns: int, new_tokens: int) -> Any:
        cache = self._static
        if cache is not None and cache.max_cache_len >= columns:
            cache.reset()  # same tensors (reallocated for another batch size or a wider protected prompt)
            name = register_attention()
            if base.config._attn_implementation != name:  # rollout_mode restored the model's own
                base.set_attn_implementation(name)
            return cache
        device = next(base.parameters()).device
        size = -(-columns // STATIC_CACHE_COLUMNS) * STATIC_CACHE_COLUMNS
        # every prompt this cache can hold fits its early region: no reallocation when prompts widen
        cache = make_decode_cache(base, self.compression, self.static_cache, device, size, size - new_tokens)
        if cache is None:
            return DynamicCache(config=base.config)
        self._static = cache if isinstance(cache, StaticHeadMixedCache) else None
        return cache

    def __call__(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        generation_config: GenerationConfig,
        *,
        temperature: float,
        eos_token_ids: list[int],
    ) -> RolloutBatch:
        """Sample completions for left-padded `input_ids` [B, P] (`model` may be PEFT-wrapped).

        Runs under no_grad in eval mode; attention implementation and mode are restored afterwards.
        """
        base = transformers_model(model)
        recorder = self._recorder
        new_tokens = generation_config.max_new_tokens or generation_config.max_length - input_ids.shape[1]
        recorder.start(new_tokens, temperature)
        with torch.no_grad(), rollout_mode(model):
            cache = self._cache(base, input_ids.shape[1] + new_tokens, new_tokens)
            compile_config = decode_compile_config(cache, input_ids.device)
            if isinstance(cache, StaticHeadMixedCache) and self.compile_config is not None:
                compile_config = self.compile_config
            if compile_config is not None:
                generation_config = copy.deepcopy(generation_config)
                generation_config.compile_config = compile_config
            hook = base.register_forward_hook(recorder, with_kwargs=True)
            try:
                # rows seen ended every few steps, not read every step
                stop = host_row_ends(eos_token_ids, input_ids.shape[1], generation_config)
                with track_peak_kv_bytes(base, cache) as peak, stop as ends:
                    sequences = model.generate(
                        input_ids=input_ids,
                        attention_mask=attention_mask,
                        generation_config=generation_config,
                        stopping_criteria=StoppingCriteriaList([ends]),
                        **cache_kwargs(cache),
                    )
            finally:
                hook.remove()
            if isinstance(cache, StaticHeadMixedCache):
                cache.after_forward()  # a compiled last step never returned to `update` in Python
            stats = _kv_stats(cache, peak[0], input_ids.shape[0])
            del cache
        completion = sequences[:, input_ids.shape[1] :]
        logprobs = recorder.finish(completion)
        lengths = first_eos_lengths(completion, eos_token_ids).tolist()
        completion_ids = [row[:n] for row, n in zip(completion.tolist(), lengths, strict=True)]
        row_logprobs = [row[:n] for row, n in zip(logprobs.tolist(), lengths, strict=True)]
        return RolloutBatch(completion_ids=completion_ids, logprobs=row_logprobs, kv=stats)


def generate_rollouts(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    compression: CompressionConfig | None,
    *,
    temperature: float,
    eos_token_ids: list[int],
    static_cache: bool | None = None,
) -> RolloutBatch:
    """One call of a fresh `RolloutGenerator(compression, static_cache)` (see it); a trainer that
    samples again keeps its generator, whose static cache then keeps its addresses."""
    generator = RolloutGenerator(compression, static_cache)
    return generator(
        model,
        input_ids,
        attention_mask,
        generation_config,
        temperature=temperature,
        eos_token_ids=eos_token_ids,
    )


def _kv_stats(cache: Any, peak: int, batch_size: int) -> CacheStats:
    resident = kv_storage_bytes(cache)
    if isinstance(cache, (HeadMixedCache, StaticHeadMixedCache)):
        rows = cache.stats()
        full = sum(r.full_resident_bytes for r in rows)
        kept, evictions = sum(r.kept_tokens for r in rows), sum(r.evictions for r in rows)
    else:
        full, evictions = resident, 0
        kept = sum(layer.keys.shape[0] * layer.keys.shape[1] * layer.keys.shape[2] for layer in cache.layers)
    return CacheStats(
        resident_bytes=resident,
        full_resident_bytes=full,
        logical_length=cache.get_seq_length(),
        kept_tokens=kept,
        evictions=evictions,
        peak_bytes=max(peak, resident),
        batch_size=batch_size,
    )
