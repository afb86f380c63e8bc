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

On TRL's vLLM path (`GRPOConfig(use_vllm=True, vllm_mode="colocate")`, a config from
`CompressedRolloutConfig.for_vllm`) the trainer is built with vLLM off and then gets the head-mixed
vLLM generation of `rlkv.rollout.vllm_rollouts`; TRL's own vLLM code samples, syncs weights and
corrects from then on, and `last_rollout_kv` is the engine's block meter reading. The rest of this
docstring is the transformers path.

What changes, per rollout (TRL's transformers path, `use_vllm=False`)
---------------------------------------------------------------------
- `generate` runs with a compressed cache passed as its cache (`rlkv.rollout.generation.RolloutGenerator`:
  a fresh `HeadMixedCache` per rollout, or on CUDA a `StaticHeadMixedCache` the trainer keeps
  between rollouts and a compiled, CUDA-graphed decode step), the model in eval mode and the
  "rlkv_cache" attention; the previous attention implementation and train/eval mode are restored
  right after, so the loss forward is the stock full-attention forward on the generated tokens.
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
import copy
import dataclasses
import functools
import inspect
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from rlkv.cache import CacheStats
from rlkv.compat import COMPRESSED_ROLLOUT_API, check_attributes, check_private_api
from rlkv.inference import CompressionConfig, CompressionConfigError
from rlkv.rollout.generation import RolloutGenerator

if TYPE_CHECKING:
    from rlkv.vllm_plugin.meter import KVMeterReading


# vllm.LLM arguments the head-mixed rollout engine needs as rlkv sets them
VLLM_OWNED_KWARGS = ("model", "hf_overrides", "scheduler_cls", "distributed_executor_backend")
_COMPRESSION_FIELDS = frozenset(f.name for f in dataclasses.fields(CompressionConfig))


@dataclasses.dataclass(init=False)
class CompressedRolloutConfig:
    """GRPO rollouts with a compressed KV cache: the compression settings beside the rollout options.

    compression: the `CompressionConfig` the rollouts generate with (head_mask, sparsity, policy, budget, ...);
        or pass its fields directly, `CompressedRolloutConfig(head_mask=..., sparsity=0.5, policy="rkv",
        budget=2048)`, which builds it. Its fields and methods read through this object too (`config.sparsity`,
        `config.full_heads(model)`).
    importance_sampling_correction: correct the rollout/loss attention mismatch with TRL's vLLM
        importance-sampling code (truncated or masked, per token or sequence: GRPOConfig's
        `vllm_importance_sampling_mode`, bounds `vllm_importance_sampling_clip_min/_clip_max`).
        Costs one extra no-grad forward per generation batch, as with vLLM.
    static_cache: None (default) decodes rollouts with the static-shape cache, compiled with CUDA
        graphs, on CUDA when the layout has a static form (the dynamic cache otherwise); True uses
        it on any device, False never (`rlkv.rollout.generation.RolloutGenerator`).
    vllm_kwargs: with `GRPOConfig(use_vllm=True)`, extra `vllm.LLM` keyword arguments (e.g.
        {"dtype": "float32", "enforce_eager": True, "block_size": 32}); they win over TRL's settings
        but for the four that make the head-mixed engine (`VLLM_OWNED_KWARGS`).

    With `use_vllm=True` the compression must be a form vLLM serves (streaming compressed heads, the prompt
    evictable): build it with `CompressedRolloutConfig.for_vllm` (by default the eval's form: sink 16 +
    window 64 after a full prompt forward).
    """

    compression: CompressionConfig
    importance_sampling_correction: bool = True
    static_cache: bool | None = None
    vllm_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __init__(
        self,
        compression: CompressionConfig | None = None,
        *,
        importance_sampling_correction: bool = True,
        static_cache: bool | None = None,
        vllm_kwargs: dict[str, Any] | None = None,
        **settings: Any,
    ) -> None:
        if compression is not None and settings:
            raise CompressionConfigError(
                f"CompressedRolloutConfig got compression= and {sorted(settings)}: give the settings in the "
                "CompressionConfig, or its fields directly without compression="
            )
        if compression is not None and not isinstance(compression, CompressionConfig):
            raise CompressionConfigError(
                f"compression has type {type(compression).__name__}: pass a rlkv.inference.CompressionConfig"
            )
        unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(CompressionConfig)})
        if unknown:
            raise CompressionConfigError(
                f"CompressedRolloutConfig: unknown field(s) {unknown}; the settings are CompressionConfig's "
                "fields, the rollout options importance_sampling_correction, static_cache and vllm_kwargs"
            )
        self.compression = compression if compression is not None else CompressionConfig(**settings)
        self.importance_sampling_correction = importance_sampling_correction
        self.static_cache = static_cache
        self.vllm_kwargs = {} if vllm_kwargs is None else vllm_kwargs
        self.validate()

    def __getattr__(self, name: str) -> Any:
        # the compression settings and their methods read through (config.sparsity, config.full_heads(model)),
        # so code written for a CompressionConfig reads this one too; only called for names this object lacks
        compression = self.__dict__.get("compression")
        if compression is not None and not name.startswith("_") and hasattr(compression, name):
            return getattr(compression, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def for_vllm(
        cls,
        head_mask: Any,
        sparsity: float,
        window: int = 64,
        *,
        sink: int = 16,
        window_prefill: bool = False,
        **kwargs: Any,
    ) -> CompressedRolloutConfig:
        """A config vLLM rollouts serve (`rlkv.inference.vllm.vllm_compression`'s fields: sink + window, the
        prompt read whole unless `window_prefill`; `policy="rkv", budget=N`: token eviction on the compressed
        heads), plus `kwargs` (the rollout options and any other `CompressionConfig` field)."""
        from rlkv.inference.vllm import vllm_compression

        settings = {k: v for k, v in kwargs.items() if k in _COMPRESSION_FIELDS}
        rollout = {k: v for k, v in kwargs.items() if k not in _COMPRESSION_FIELDS}
        form = vllm_compression(
            head_mask, sparsity, sink=sink, window=window, window_prefill=window_prefill, **settings
        )
        return cls(form, **rollout)

    def validate(self) -> None:
        """Check the rollout options (the compression settings were checked when they were built)."""
        if not isinstance(self.importance_sampling_correction, bool):
            raise CompressionConfigError(
                f"importance_sampling_correction={self.importance_sampling_correction!r}: must be True or False"
            )
        if self.static_cache not in (None, True, False):
            raise CompressionConfigError(
                f"static_cache={self.static_cache!r}: must be None (static on CUDA), True or False"
            )
        if not isinstance(self.vllm_kwargs, dict) or not all(isinstance(k, str) for k in self.vllm_kwargs):
            raise CompressionConfigError(
                f"vllm_kwargs={self.vllm_kwargs!r}: must be a dict of vllm.LLM keyword arguments"
            )
        owned = sorted(set(self.vllm_kwargs) & set(VLLM_OWNED_KWARGS))
        if owned:
            raise CompressionConfigError(
                f"vllm_kwargs sets {owned}: rlkv sets {list(VLLM_OWNED_KWARGS)} to build the head-mixed engine; "
                "drop them (the model is the trainer's model.name_or_path)"
            )


# A rollout batch's KV memory: `CacheStats` of the whole batch on this process (bytes and counts
# summed over rows; logical_length counts columns, padding included; peak_bytes: the largest
# storage seen between decode steps). The old name stays for user code.
RolloutKVStats = CacheStats


class CompressedRolloutTrainerMixin:
    """GRPOTrainer mixin: rollouts with a head-mixed compressed KV cache (see the module docstring).

    Extra constructor argument `rollout_compression: CompressedRolloutConfig | None`; None keeps
    the stock trainer's behaviour. The head mask is loaded and checked against the model (the
    PEFT base model's config) at construction. `rollout_generator` (a `RolloutGenerator`) samples
    every rollout and keeps a static cache between them.
    """

    def __init__(self, *args: Any, rollout_compression: CompressedRolloutConfig | None = None, **kwargs: Any):
        check_private_api(type(self), COMPRESSED_ROLLOUT_API, feature="compressed rollouts")
        vllm_args = None
        if rollout_compression is not None:
            args, kwargs, vllm_args = self._construct_without_vllm(args, kwargs)
        super().__init__(*args, **kwargs)
        check_attributes(self, COMPRESSED_ROLLOUT_API, feature="compressed rollouts")
        self.rollout_compression = rollout_compression
        self.last_rollout_kv: CacheStats | KVMeterReading | None = None
        self._vllm_rollouts = vllm_args is not None
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
        compression = rollout_compression.compression
        self._rollout_cache_config = dataclasses.replace(
            compression, head_mask=compression.resolve_head_mask(base)
        )
        self._rollout_cache_config.full_heads(base)
        self.vllm_importance_sampling_correction = rollout_compression.importance_sampling_correction
        if self._vllm_rollouts:
            self._start_vllm(vllm_args, base)
            return
        self.rollout_generator = RolloutGenerator(
            self._rollout_cache_config, rollout_compression.static_cache
        )

    def _construct_without_vllm(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, Any]:
        """The trainer's arguments with a shallow copy of a `use_vllm=True` GRPOConfig whose vLLM is off (so TRL
        starts no stock engine), and that GRPOConfig (None when vLLM is off)."""
        bound = inspect.signature(super().__init__).bind(*args, **kwargs)
        train_args = bound.arguments.get("args")
        if train_args is None or not getattr(train_args, "use_vllm", False):
            return args, kwargs, None
        from rlkv.rollout.vllm_rollouts import refuse_unsupported_vllm

        problems = refuse_unsupported_vllm(train_args)
        if problems:
            raise ValueError("rollout_compression cannot be used with " + "; ".join(problems))
        bound.arguments["args"] = copy.copy(train_args)
        bound.arguments["args"].use_vllm = False
        return bound.args, bound.kwargs, train_args

    def _start_vllm(self, vllm_args: Any, base: Any) -> None:
        """Install the head-mixed vLLM generation where TRL keeps its own (TRL's vLLM branches then run on it)."""
        from rlkv.compat import COMPRESSED_VLLM_TRAINER_API
        from rlkv.inference.vllm import compression_overrides
        from rlkv.rollout.vllm_rollouts import FEATURE, make_vllm_generation

        check_attributes(self, COMPRESSED_VLLM_TRAINER_API, feature=FEATURE)
        overrides = compression_overrides(base, self._rollout_cache_config)
        self.args.use_vllm = True  # the trainer's copy says what the user configured (saved with checkpoints)
        self.use_vllm, self.vllm_mode = True, "colocate"
        self.vllm_generation = make_vllm_generation(
            self, vllm_args, overrides, self.rollout_compression.vllm_kwargs
        )
        self._last_loaded_step = -1  # TRL syncs the weights before the first rollout
        self.rollout_generator = None

    def _refuse_unsupported_setup(self) -> None:
        problems = []
        if self.use_vllm:  # vLLM is off during construction unless TRL was not asked for it by GRPOConfig
            problems.append("use_vllm=True set after construction (set it in GRPOConfig)")
        if self.use_transformers_continuous_batching:
            problems.append("use_transformers_continuous_batching=True (set it to False)")
        if self.rollout_func is not None:
            problems.append("rollout_func (it replaces the generation that the compressed cache serves)")
        if self.tools:
            problems.append("tools / environment_factory (multi-turn tool loops are not supported)")
        if self._is_vlm:
            problems.append("a vision-language model (text-only models are supported)")
        if self.args.cache_implementation is not None and not self._vllm_rollouts:
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
        if self.rollout_compression is None or self._vllm_rollouts:
            meter = self.vllm_generation.kv_meter() if self._vllm_rollouts else None
            if meter is not None:
                meter.reset_meter()
            result = super()._generate_single_turn(
                prompt_ids, images, multimodal_fields, num_generations, has_tool_images=has_tool_images
            )
            if meter is not None:
                self._log_rollout_kv(meter.meter_reading())
            return result
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
            batch = self.rollout_generator(
                unwrapped_model,
                input_ids,
                attention_mask,
                self.generation_config,
                temperature=self.temperature,
                eos_token_ids=self.eos_token_ids,
            )
        self._log_rollout_kv(batch.kv)
        return batch.completion_ids, batch.logprobs

    def _log_rollout_kv(self, kv: CacheStats | KVMeterReading) -> None:
        self.last_rollout_kv = kv
        mode = "train" if self.model.training else "eval"
        if isinstance(kv, CacheStats):
            values = {
                "rollout_kv/resident_bytes": kv.resident_bytes,
                "rollout_kv/peak_bytes": kv.peak_bytes,
                "rollout_kv/full_bytes": kv.full_resident_bytes,
                "rollout_kv/resident_ratio": kv.resident_ratio,
                "rollout_kv/kept_tokens": kv.kept_tokens,
                "rollout_kv/evictions": kv.evictions,
            }
        else:  # vLLM: blocks in use at the rollout's peak, against a full cache of the same requests
            values = {
                "rollout_kv/peak_bytes": kv.peak_bytes,
                "rollout_kv/full_bytes": kv.full_bytes,
                "rollout_kv/resident_ratio": kv.ratio,
                "rollout_kv/peak_blocks": kv.peak_blocks,
                "rollout_kv/full_blocks": kv.peak_full_blocks,
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
        # on vLLM, use_vllm stays True and TRL's correction runs as for any vLLM rollout
        return (
            self.rollout_compression is not None
            and not self._vllm_rollouts
            and self.vllm_importance_sampling_correction
        )

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
