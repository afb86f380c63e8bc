"""Compressed KV cache inside TRL GRPO rollouts: the RL-rollout memory saver.

    from trl import GRPOConfig, GRPOTrainer
    from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts

    trainer = with_compressed_rollouts(GRPOTrainer)(
        model=..., args=GRPOConfig(...), reward_funcs=...,
        rollout_compression=CompressedRolloutConfig(head_mask="mask.json", sparsity=0.5, policy="rkv", budget=2048),
    )

Why a subclass factory (and not a `rollout_func` or a callback)
--------------------------------------------------------------
TRL 1.16 has three extension points. A callback cannot change how completions are sampled. A
`rollout_func` replaces the whole rollout (chat templating, tokenisation, multimodal and tool
handling) and is marked experimental. `GRPOTrainer._generate_single_turn` is the one method that
turns token ids into completions; overriding only it keeps everything else TRL's own (prompt
handling, rewards, advantages, logging, the loss). `with_compressed_rollouts(cls)` builds that
subclass for any `GRPOTrainer` subclass, so it composes with other customised trainers.

What changes, per rollout (TRL's transformers path, `use_vllm=False`)
---------------------------------------------------------------------
- `generate` runs with a fresh `HeadMixedCache` from `rlkv.inference.make_cache` passed as
  `past_key_values`, the model in eval mode and the "rlkv_cache" attention; the previous
  attention implementation and train/eval mode are restored right after, so the loss forward
  is the stock full-attention forward on the generated tokens.
- Per rollout the cache's resident bytes (read from tensor storage), the peak between decode
  steps, the full-cache equivalent, kept tokens and evictions go to TRL's metrics as
  `rollout_kv/*`.
- Rollout log-probs: `log_softmax(logits / temperature)` of each sampled token under the
  compressed attention, from the model's raw logits (a forward hook; only one [B, vocab] row
  is held at a time). That is the distribution TRL's loss evaluates (it too ignores logits
  processors such as min_new_tokens or repetition_penalty and top-k/top-p), so the ratio
  measures the compressed-vs-full attention mismatch alone.
- Off-policy correction reuses TRL's vLLM importance-sampling code unchanged: TRL gates it on
  `use_vllm and vllm_importance_sampling_correction`; the trainer raises `use_vllm` only while
  `_generate_and_score_completions` / `_compute_loss` run (nothing there touches vLLM once
  `_generate_single_turn` is ours, `rollout_func` and tools are refused). The mode and bounds
  are GRPOConfig's `vllm_importance_sampling_mode`, `_clip_min`, `_clip_max`; TRL logs
  `sampling/importance_sampling_ratio/{min,mean,max}` and `sampling/sampling_logp_difference/*`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig

from rlkv.cache import CacheStats, HeadMixedCache, storage_bytes
from rlkv.compat import (
    COMPRESSED_ROLLOUT_API,
    cache_kwargs,
    check_attributes,
    check_private_api,
)
from rlkv.inference import CompressionConfig, CompressionConfigError, make_cache
from rlkv.inference.api import host_row_ends


@dataclasses.dataclass
class CompressedRolloutConfig(CompressionConfig):
    """`CompressionConfig` for GRPO rollouts (all its fields: head_mask, sparsity, policy, budget, ...).

    importance_sampling_correction: correct the rollout/loss attention mismatch with TRL's vLLM
        importance-sampling code (truncated or masked, per token or sequence: GRPOConfig's
        `vllm_importance_sampling_mode`, bounds `vllm_importance_sampling_clip_min/_clip_max`).
        Costs one extra no-grad forward per generation batch, as with vLLM.
    """

    importance_sampling_correction: bool = True

    def validate(self) -> None:
        """`CompressionConfig.validate` plus the rollout fields."""
        super().validate()
        if not isinstance(self.importance_sampling_correction, bool):
            raise CompressionConfigError(
                f"importance_sampling_correction={self.importance_sampling_correction!r}: must be True or False"
            )


# A rollout batch's KV memory: `CacheStats` of the whole batch on this process (bytes and counts
# summed over rows; logical_length counts columns, padding included; peak_bytes: the largest
# storage seen between decode steps). The old name stays for user code.
RolloutKVStats = CacheStats


@dataclasses.dataclass
class RolloutBatch:
    """Completions of one `generate_rollouts` call.

    completion_ids[i]: generated tokens of row i up to and including its first EOS (TRL's rule);
    logprobs[i]: log-softmax(raw logits / temperature) of those tokens; kv: memory stats.
    """

    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    kv: CacheStats


class SampledLogprobRecorder:
    """Forward hook recording log p(sampled token) under `logits / temperature`, one [B] column per step.

    It reads the model's raw last-position logits (before generate's logits processors and
    warpers: what TRL's loss evaluates); the token sampled after forward t arrives as the
    `input_ids` of forward t + 1 (the last one in `finish`), so only one [B, vocab] row is kept.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = float(temperature)
        self.columns: list[torch.Tensor] = []
        self.pending: torch.Tensor | None = None

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        input_ids = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
        if self.pending is not None:
            self.columns.append(self.pending.gather(1, input_ids[:, -1:]).squeeze(1))
        self.pending = torch.log_softmax(output.logits[:, -1].float() / self.temperature, dim=-1)

    def finish(self, completion_ids: torch.Tensor) -> torch.Tensor:
        """FloatTensor [B, N] for the N generated tokens `completion_ids` [B, N]."""
        num = completion_ids.shape[1]
        if len(self.columns) < num and self.pending is not None:
            self.columns.append(self.pending.gather(1, completion_ids[:, num - 1 : num]).squeeze(1))
        self.pending = None
        if num == 0:
            return torch.zeros(completion_ids.shape, dtype=torch.float32, device=completion_ids.device)
        return torch.stack(self.columns[:num], dim=1)


def kv_storage_bytes(cache: Any) -> int:
    """Bytes held by a KV cache's tensors, read from their storage (HeadMixedCache or a stock Cache)."""
    if isinstance(cache, HeadMixedCache):
        return cache.resident_bytes()
    return storage_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])


@contextlib.contextmanager
def track_peak_kv_bytes(model: torch.nn.Module, cache: Any) -> Iterator[list[int]]:
    """Context: yields a one-element list holding the largest `kv_storage_bytes(cache)` after any forward."""
    peak = [0]

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


def generate_rollouts(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    generation_config: GenerationConfig,
    compression: CompressionConfig | None,
    *,
    temperature: float,
    eos_token_ids: list[int],
) -> RolloutBatch:
    """Sample completions for left-padded `input_ids` [B, P] with a compressed (or, None, a stock) KV cache.

    `model` may be PEFT-wrapped. With `compression` a fresh `HeadMixedCache` serves this call;
    without, a stock `DynamicCache` under the model's own attention (the full-cache reference).
    Runs under no_grad in eval mode; attention implementation and mode are restored afterwards.
    """
    base = transformers_model(model)
    recorder = SampledLogprobRecorder(temperature)
    with torch.no_grad(), rollout_mode(model):
        if compression is None:
            cache = DynamicCache(config=base.config)
        else:
            cache = make_cache(base, compression, batch_size=input_ids.shape[0])
        hook = base.register_forward_hook(recorder, with_kwargs=True)
        try:
            # rows seen ended every few steps, not read every step
            stop = host_row_ends(eos_token_ids, input_ids.shape[1], generation_config)
            with track_peak_kv_bytes(base, cache) as peak, stop as stopping:
                sequences = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    generation_config=generation_config,
                    stopping_criteria=stopping,
                    **cache_kwargs(cache),
                )
        finally:
            hook.remove()
        stats = _kv_stats(cache, peak[0], input_ids.shape[0])
        del cache
    completion = sequences[:, input_ids.shape[1] :]
    logprobs = recorder.finish(completion)
    lengths = first_eos_lengths(completion, eos_token_ids).tolist()
    completion_ids = [row[:n] for row, n in zip(completion.tolist(), lengths, strict=True)]
    row_logprobs = [row[:n] for row, n in zip(logprobs.tolist(), lengths, strict=True)]
    return RolloutBatch(completion_ids=completion_ids, logprobs=row_logprobs, kv=stats)


def _kv_stats(cache: Any, peak: int, batch_size: int) -> CacheStats:
    resident = kv_storage_bytes(cache)
    if isinstance(cache, HeadMixedCache):
        rows = cache.stats()
        full = cache.full_resident_bytes()
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


class CompressedRolloutTrainerMixin:
    """GRPOTrainer mixin: rollouts with a head-mixed compressed KV cache (see the module docstring).

    Extra constructor argument `rollout_compression: CompressedRolloutConfig | None`; None keeps
    the stock trainer's behaviour. The head mask is loaded and checked against the model (the
    PEFT base model's config) at construction.
    """

    def __init__(self, *args: Any, rollout_compression: CompressedRolloutConfig | None = None, **kwargs: Any):
        check_private_api(type(self), COMPRESSED_ROLLOUT_API, feature="compressed rollouts")
        super().__init__(*args, **kwargs)
        check_attributes(self, COMPRESSED_ROLLOUT_API, feature="compressed rollouts")
        self.rollout_compression = rollout_compression
        self.last_rollout_kv: CacheStats | None = None
        if rollout_compression is None:
            return
        if not isinstance(rollout_compression, CompressedRolloutConfig):
            raise TypeError(
                f"rollout_compression has type {type(rollout_compression).__name__}: pass a "
                "rlkv.rollout.CompressedRolloutConfig"
            )
        self._refuse_unsupported_setup()
        # the mask file is read once; each rollout builds its cache from the loaded HeadMask
        # HeadMaskError now (naming the mismatch), not at the first rollout; a PEFT model's
        # fingerprint is its base model's
        base = self.accelerator.unwrap_model(self.model)
        self._rollout_cache_config = dataclasses.replace(
            rollout_compression, head_mask=rollout_compression.resolve_head_mask(base)
        )
        self._rollout_cache_config.full_heads(base)
        self.vllm_importance_sampling_correction = rollout_compression.importance_sampling_correction

    def _refuse_unsupported_setup(self) -> None:
        problems = []
        if self.use_vllm:
            problems.append(
                "use_vllm=True (compressed rollouts replace transformers generation; set use_vllm=False)"
            )
        if self.use_transformers_continuous_batching:
            problems.append("use_transformers_continuous_batching=True (set it to False)")
        if self.rollout_func is not None:
            problems.append("rollout_func (it replaces the generation that the compressed cache serves)")
        if self.tools:
            problems.append("tools / environment_factory (multi-turn tool loops are not supported)")
        if self._is_vlm:
            problems.append("a vision-language model (text-only models are supported)")
        if self.args.cache_implementation is not None:
            problems.append(
                f"cache_implementation={self.args.cache_implementation!r} (the compressed cache replaces it)"
            )
        if getattr(self.accelerator.unwrap_model(self.model), "rlkv_gates", None) is not None:
            problems.append("a model with rlkv gates (rollouts would drop the gated mixed attention)")
        if problems:
            raise ValueError("rollout_compression cannot be used with " + "; ".join(problems))

    # generation ----------------------------------------------------------------------------
    def _generate_single_turn(
        self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False
    ):
        if self.rollout_compression is None:
            return super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
        from trl.extras.profiling import profiling_context
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        device = self.accelerator.device
        prompts = [torch.tensor(ids) for ids in prompt_ids]
        pad_kwargs = dict(padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        input_ids = pad(prompts, padding_value=self._tokenizer.pad_token_id, **pad_kwargs).to(device)
        attention_mask = pad([torch.ones_like(t) for t in prompts], padding_value=0, **pad_kwargs).to(device)
        with (
            profiling_context(self, "rlkv.compressed_generate"),
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                generation_kwargs=self.generation_kwargs,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            batch = generate_rollouts(
                unwrapped_model,
                input_ids,
                attention_mask,
                self.generation_config,
                self._rollout_cache_config,
                temperature=self.temperature,
                eos_token_ids=self.eos_token_ids,
            )
        self._log_rollout_kv(batch.kv)
        return batch.completion_ids, batch.logprobs

    def _log_rollout_kv(self, kv: CacheStats) -> None:
        self.last_rollout_kv = kv
        mode = "train" if self.model.training else "eval"
        values = {
            "rollout_kv/resident_bytes": kv.resident_bytes,
            "rollout_kv/peak_bytes": kv.peak_bytes,
            "rollout_kv/full_bytes": kv.full_resident_bytes,
            "rollout_kv/resident_ratio": kv.resident_ratio,
            "rollout_kv/kept_tokens": kv.kept_tokens,
            "rollout_kv/evictions": kv.evictions,
        }
        local = torch.tensor(list(values.values()), dtype=torch.float64, device=self.accelerator.device)
        mean = self.accelerator.gather(local[None]).mean(dim=0).tolist()  # per-process average
        for name, value in zip(values, mean, strict=True):
            self._metrics[mode][name].append(value)

    # importance sampling through TRL's vLLM code path --------------------------------------
    @contextlib.contextmanager
    def _trl_importance_sampling(self, active: bool) -> Iterator[None]:
        """Let TRL's `use_vllm and vllm_importance_sampling_correction` branches see compressed rollouts."""
        if not active:
            yield
            return
        self.use_vllm = True
        try:
            yield
        finally:
            self.use_vllm = False

    def _compressed_is_active(self) -> bool:
        return self.rollout_compression is not None and self.vllm_importance_sampling_correction

    def _generate_and_score_completions(self, inputs):
        with self._trl_importance_sampling(self._compressed_is_active()):
            return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        active = self._compressed_is_active() and "importance_sampling_ratio" in inputs
        with self._trl_importance_sampling(active):
            return super()._compute_loss(model, inputs)


@functools.cache
def with_compressed_rollouts(trainer_cls: type) -> type:
    """A subclass of `trainer_cls` (a `trl.GRPOTrainer` subclass) whose rollouts use a compressed KV cache.

    The subclass takes one extra keyword argument, `rollout_compression: CompressedRolloutConfig`.
    The same class object is returned for the same `trainer_cls`.
    """
    from trl import GRPOTrainer

    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, GRPOTrainer)):
        raise TypeError(f"with_compressed_rollouts needs a trl.GRPOTrainer subclass, got {trainer_cls!r}")
    return type(
        f"CompressedRollout{trainer_cls.__name__}",
        (CompressedRolloutTrainerMixin, trainer_cls),
        {"__module__": __name__, "__doc__": f"{trainer_cls.__name__} with compressed-KV rollouts (rlkv)."},
    )
