"""Compressed rollouts on vLLM: TRL's colocated vLLM generation, serving the head-mixed model of rlkv's plugin.

`with_compressed_rollouts(GRPOTrainer)` with `GRPOConfig(use_vllm=True, vllm_mode="colocate")` builds
this module's `VLLMGeneration` subclass in place of TRL's (the mixin constructs the trainer with vLLM off,
so TRL starts no engine of its own, then installs this one). What it changes against TRL's:

- the engine: `vllm.LLM(model.name_or_path, hf_overrides=...)` with the head split of the rollout config
  (`rlkv.inference.vllm.compression_overrides`: full heads full, the others a sliding window), the
  KV-metering scheduler (`rlkv.vllm_plugin.meter`) and the config's `vllm_kwargs`; TRL's other engine
  settings (external launcher, processed log-probs, 4,096 batched tokens, the GRPOConfig vLLM fields).
- the weight sync: every parameter (PEFT adapters merged, FSDP / DeepSpeed gathered: TRL's own
  iterator) through vLLM's `reload_weights(weights_iterator=...)` (`rlkv.vllm_plugin.fence`), which
  works on CPU too; TRL's per-tensor `model.load_weights` fails on vLLM's CPU layers.

Generation, log-probs (vLLM's, after temperature: TRL's importance-sampling correction reads them) and
the sampling parameters stay TRL's. Server mode (`trl vllm-serve`) is refused: its weight sync is an
NCCL broadcast into a server that loads its model without the split.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from rlkv.compat import VLLM_GENERATION_API, check_attributes, check_private_api

FEATURE = "compressed rollouts on vLLM"


def refuse_unsupported_vllm(args: Any) -> list[str]:
    """Problems of a GRPOConfig with `use_vllm=True` for compressed rollouts (empty: supported)."""
    problems = []
    if args.vllm_mode != "colocate":
        problems.append(
            f"vllm_mode={args.vllm_mode!r} (trl vllm-serve loads its model without rlkv's head split and syncs "
            "weights over NCCL; use vllm_mode='colocate')"
        )
    if args.vllm_tensor_parallel_size != 1:
        problems.append(
            f"vllm_tensor_parallel_size={args.vllm_tensor_parallel_size} (rlkv's vLLM plugin serves one device)"
        )
    return problems


def make_vllm_generation(
    trainer: Any, args: Any, hf_overrides: dict[str, Any], llm_kwargs: dict[str, Any]
) -> Any:
    """The head-mixed `VLLMGeneration` for `trainer` (a GRPOTrainer built with vLLM off) and its GRPOConfig `args`."""
    cls = head_mixed_vllm_generation_class()
    check_private_api(cls, VLLM_GENERATION_API, feature=FEATURE)
    generation = cls(
        model=trainer.model,
        accelerator=trainer.accelerator,
        processing_class=trainer.processing_class,
        mode="colocate",
        structured_outputs_regex=args.vllm_structured_outputs_regex,
        gpu_memory_utilization=args.vllm_gpu_memory_utilization,
        max_model_length=args.vllm_max_model_length,
        max_num_seqs=args.per_device_train_batch_size * args.steps_per_generation,
        enable_sleep_mode=args.vllm_enable_sleep_mode,
        model_impl=args.vllm_model_impl,
        trust_remote_code=args.trust_remote_code,
        repetition_penalty=trainer.repetition_penalty,
        temperature=trainer.temperature,
        top_p=trainer.top_p,
        top_k=trainer.top_k,
        min_p=trainer.min_p,
        max_completion_length=trainer.max_completion_length,
        logprobs=0,  # the sampled token's log-prob only: what the importance-sampling correction reads
        generation_kwargs=args.generation_kwargs,
        rlkv_hf_overrides=hf_overrides,
        rlkv_llm_kwargs=llm_kwargs,
    )
    check_attributes(generation, VLLM_GENERATION_API, feature=FEATURE)
    return generation


def vllm_model_path(model: Any) -> str:
    """The folder or Hub id vLLM loads its copy of `model` from (`name_or_path`); an error names the fix."""
    path = getattr(model, "name_or_path", "") or ""
    if not path:
        raise ValueError(
            "rollout_compression with use_vllm=True needs a model loaded from a folder or Hub id (vLLM loads "
            "its own copy from model.name_or_path, which is empty for a model built in memory): save it with "
            "model.save_pretrained(DIR) and pass AutoModelForCausalLM.from_pretrained(DIR)"
        )
    return str(path)


@functools.cache
def head_mixed_vllm_generation_class() -> type:
    """TRL's `VLLMGeneration` subclass that starts the head-mixed engine and syncs weights in place."""
    from trl.generation.vllm_generation import VLLMGeneration

    class HeadMixedVLLMGeneration(VLLMGeneration):
        """TRL's colocated vLLM generation on rlkv's head-mixed model (see `rlkv.rollout.vllm_rollouts`)."""

        def __init__(
            self,
            *args: Any,
            rlkv_hf_overrides: dict[str, Any],
            rlkv_llm_kwargs: dict[str, Any],
            **kwargs: Any,
        ):
            self.rlkv_hf_overrides, self.rlkv_llm_kwargs = rlkv_hf_overrides, dict(rlkv_llm_kwargs)
            super().__init__(*args, **kwargs)

        def _init_vllm(self) -> None:
            from trl.trainer.utils import ensure_master_addr_port

            from rlkv.inference.dtypes import dtype_name
            from rlkv.inference.vllm_engine import cpu_kv_cache, import_vllm

            vllm = import_vllm()
            from rlkv.vllm_plugin.meter import KVMeteredScheduler

            accelerator = self.accelerator
            # the external launcher joins torch.distributed as this process's rank, as in TRL's colocate mode
            os.environ["RANK"] = str(accelerator.process_index)
            os.environ["LOCAL_RANK"] = str(accelerator.local_process_index)
            os.environ["WORLD_SIZE"] = str(accelerator.num_processes)
            ensure_master_addr_port()
            settings: dict[str, Any] = {
                "model": vllm_model_path(self.model),
                "hf_overrides": self.rlkv_hf_overrides,
                "tensor_parallel_size": 1,
                "gpu_memory_utilization": self.gpu_memory_utilization,
                "max_model_len": self.max_model_length,
                "max_num_seqs": self.max_num_seqs,
                "enable_sleep_mode": self.enable_sleep_mode,
                "model_impl": "vllm",  # the plugin's head-mixed classes are vLLM implementations
                "distributed_executor_backend": "external_launcher",
                "seed": accelerator.process_index,
                "max_num_batched_tokens": 4096,
                "logprobs_mode": "processed_logprobs",  # log-probs after temperature, as TRL's correction needs
                "trust_remote_code": self.trust_remote_code,
                "scheduler_cls": KVMeteredScheduler,
            }
            # the trained model's dtype (vLLM's own "auto" would downcast an fp32 model to bf16: rollouts and
            # the loss forward in two dtypes); on CPU a KV cache sized from free memory, not from this
            # process's RSS, which holds the trainer's model and optimizer
            weights = next(self.model.parameters())
            settings["dtype"] = dtype_name(weights.dtype)
            settings |= self.rlkv_llm_kwargs
            weight_bytes = sum(p.numel() for p in self.model.parameters()) * weights.element_size()
            self.llm = vllm.LLM(**(settings | cpu_kv_cache(settings, weight_bytes)))
            if self.enable_sleep_mode:
                self.llm.sleep(level=2)
            self._llm_weights_sleeping = self.enable_sleep_mode
            accelerator.wait_for_everyone()

        def sync_weights(self) -> None:
            from rlkv.vllm_plugin.fence import reload_weights

            if self.enable_sleep_mode:
                self.llm.wake_up(tags=["weights"])
                self._llm_weights_sleeping = False
            reload_weights(self.llm, self._iter_named_params())
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights

        def kv_meter(self) -> Any:
            """The engine's `KVMeteredScheduler` (None if its core runs in another process)."""
            from rlkv.vllm_plugin.meter import engine_meter

            return engine_meter(self.llm)

    return HeadMixedVLLMGeneration
