"""`GateGRPOTrainer`: TRL's GRPOTrainer training only RLKV's head gates, with the adaptive L1 penalty.

What it changes in TRL (everything else, GRPO included, is TRL's):
- the model gets `rlkv.attach_gates` (frozen weights, gated mixed attention in training forwards
  and in generation, so rollouts come from the gated policy itself);
- `_calculate_rewards` records r_bar, the mean raw reward of the step's generation batch over
  all ranks; `_compute_loss` adds `beta' * mean(|alpha|)` scaled for gradient accumulation as
  TRL scales its loss;
- the gates are clamped to [0, 1] after each optimizer step (`GateClampCallback`);
- the prompt sampler is reseeded per epoch (`EpochSeededSampler`), so a run resumed in a later
  epoch sees the order an uninterrupted run would;
- checkpoints hold the gates only (`gates.safetensors` + config + head_mask.json/tsv) plus
  transformers' optimizer / scheduler / RNG / trainer state, and resume restores alpha exactly;
- gate statistics are added to every training log record.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import create_model_from_path

from rlkv.compat import GATE_TRAINER_API, check_attributes, check_private_api
from rlkv.cpu_memory import keep_freed_memory
from rlkv.gates import attach_gates
from rlkv.gates.heads import full_alpha
from rlkv.head_mask import HeadMask, rank_heads
from rlkv.trainers.callbacks import GateClampCallback, HeadMaskExportCallback, gate_statistics
from rlkv.trainers.checkpoints import load_below_zero, load_gate_checkpoint, save_gate_checkpoint
from rlkv.trainers.config import GateGRPOConfig
from rlkv.trainers.data_order import EpochSeededSampler
from rlkv.trainers.logprobs import completion_logps
from rlkv.trainers.sampling import rollout_generation

logger = logging.getLogger(__name__)


def penalty_weight(
    mean_reward: float, l1_beta: float, reward_threshold: float, adaptive: bool = True
) -> float:
    """beta' of RLKV: `1[r_bar > tau] * beta * (exp(r_bar) - 1)` if adaptive, else `beta`.

    A NaN mean reward (every completion unscorable) gives 0 when adaptive: no evidence, no penalty.
    """
    if not adaptive:
        return float(l1_beta)
    if math.isnan(mean_reward) or mean_reward <= reward_threshold:
        return 0.0
    return float(l1_beta * math.expm1(mean_reward))


def set_cpu_threads(requested: int = 0) -> int:
    """Set torch's intra-op threads: `requested`, or (0) the usable cores / the ranks on this machine.

    Logged, since `accelerate launch` exports OMP_NUM_THREADS=1 unless told otherwise. Returns the count.
    """
    local_ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads = requested or max(1, cores // local_ranks)
    if threads != torch.get_num_threads():
        logger.info(
            "torch threads: %d -> %d (%d cores, %d local ranks)",
            torch.get_num_threads(),
            threads,
            cores,
            local_ranks,
        )
        torch.set_num_threads(threads)
    return threads


def l1_penalty(alpha: torch.Tensor, weight: float, scope: torch.Tensor | None = None) -> torch.Tensor:
    """`weight / (L * H) * ||alpha||_1` as a differentiable scalar; with `scope` (BoolTensor like alpha),
    the sum runs over those gates only (each still weighted 1 / (L * H))."""
    if scope is None:
        return weight * alpha.abs().mean()
    return weight * (alpha.abs() * scope).sum() / alpha.numel()


def outside_target(alpha: torch.Tensor, below_zero: torch.Tensor, target_sparsity: float) -> torch.Tensor:
    """BoolTensor like `alpha` [L, H_kv]: the heads outside the top round((1 - s) * L * H) by gate value
    (ties by `below_zero`), i.e. those the mask at `target_sparsity` would compress. No host read."""
    keep = round((1.0 - target_sparsity) * alpha.numel())
    scope = torch.ones(alpha.numel(), dtype=torch.bool, device=alpha.device)
    scope[rank_heads(alpha.detach(), below_zero.to(alpha.device))[:keep]] = False
    return scope.view_as(alpha)


def init_gates_from_mask(gates: Any, model: Any, source: str, high: float, low: float) -> None:
    """Set `gates.alpha` from the ranking of the head mask at `source`: the mask's most important head
    gets `high`, its least important `low`, the rest evenly spaced by rank (`HeadMaskError` for a mask
    of another geometry)."""
    mask = HeadMask.from_pretrained(source, model)
    order = rank_heads(mask.scores, mask.tie_break)
    steps = torch.linspace(high, low, order.numel()) if order.numel() > 1 else torch.tensor([high])
    values = torch.empty(order.numel())
    values[order] = steps
    with torch.no_grad():
        gates.alpha.copy_(values.view_as(gates.alpha).to(gates.alpha))


class GateGRPOTrainer(GRPOTrainer):
    """GRPO on RLKV gates. Arguments as `trl.GRPOTrainer`; `args` must be a `GateGRPOConfig`.

    `model` is a model path or a `PreTrainedModel`; gates are attached here (sink/local/init from
    `args`) unless the model already carries `rlkv_gates`. `peft_config` is not accepted: the
    gates are the only trainable tensor.
    """

    def __init__(
        self, model: Any, reward_funcs: Any = None, args: GateGRPOConfig | None = None, **kwargs: Any
    ):
        check_private_api(type(self), GATE_TRAINER_API, feature="GateGRPOTrainer")
        if not isinstance(args, GateGRPOConfig):
            raise TypeError(f"args must be a rlkv.trainers.GateGRPOConfig, got {type(args).__name__}")
        if kwargs.get("peft_config") is not None:
            raise ValueError("peft_config is not supported: GateGRPOTrainer trains only the rlkv gates")
        train_dataset = kwargs.get("train_dataset")
        if train_dataset is not None and hasattr(train_dataset, "__len__"):
            if len(train_dataset) == 0:
                raise ValueError("train_dataset is empty: check the dataset path/name, split and filters")
            if "prompt" not in train_dataset.column_names:
                raise ValueError(
                    f"train_dataset has no 'prompt' column (columns: {train_dataset.column_names}); "
                    "build prompts with train_gates.py's prompt_template or add the column"
                )
        if isinstance(model, str):
            init_kwargs = dict(args.model_init_kwargs or {})
            if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
                init_kwargs["device_map"] = None
            model = create_model_from_path(model, **init_kwargs)
            args.model_init_kwargs = None  # consumed here; TRL would warn that they are ignored
        gates = getattr(model, "rlkv_gates", None)
        if gates is None:
            gates = attach_gates(model, sink=args.gate_sink, local=args.gate_local, init=args.gate_init)
            if args.gate_init_from:
                init_gates_from_mask(gates, model, args.gate_init_from, args.gate_init, args.gate_init_low)
        elif args.gate_init_from:
            raise ValueError(
                "gate_init_from sets the gates this trainer attaches, but the model already carries rlkv_gates: "
                "drop gate_init_from or pass a model without gates"
            )
        elif (gates.sink, gates.local) != (args.gate_sink, args.gate_local):
            raise ValueError(
                f"model already has rlkv gates with sink/local {gates.sink}/{gates.local} but args say "
                f"gate_sink/gate_local {args.gate_sink}/{args.gate_local}; make them agree"
            )
        trainable = [name for name, p in model.named_parameters() if p.requires_grad]
        if trainable != ["rlkv_gates.alpha"]:
            raise ValueError(
                f"only rlkv_gates.alpha may be trainable, found trainable parameters {trainable}"
            )
        run_metadata = {
            "trainer": "rlkv.trainers.GateGRPOTrainer",
            "l1_beta": args.l1_beta,
            "reward_threshold": args.reward_threshold,
            "adaptive_penalty": args.adaptive_penalty,
            "target_sparsity": args.target_sparsity,
            "penalty_scope": args.penalty_scope,
            **({"gate_init_from": args.gate_init_from} if args.gate_init_from else {}),
        }
        callbacks = [
            *(kwargs.pop("callbacks", None) or []),
            GateClampCallback(),
            HeadMaskExportCallback(run_metadata),
        ]
        set_cpu_threads(args.torch_threads)
        if args.use_cpu or not torch.cuda.is_available():
            keep_freed_memory()  # rollouts free and reallocate [B, vocabulary] tensors every step
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, callbacks=callbacks, **kwargs)
        check_attributes(self, GATE_TRAINER_API, feature="GateGRPOTrainer")
        self._run_metadata = run_metadata
        self._mean_reward = {"train": math.nan, "eval": math.nan}

    # the gates ------------------------------------------------------------------------------
    @property
    def gates(self):
        """The `HeadGates` module of the (unwrapped) model."""
        return self.accelerator.unwrap_model(self.model).rlkv_gates

    # data order -----------------------------------------------------------------------------
    def _get_train_sampler(self, dataset=None):
        return EpochSeededSampler(super()._get_train_sampler(dataset))

    # rollouts -------------------------------------------------------------------------------
    def _generate_single_turn(self, *args, **kwargs):
        if self.use_vllm or self.use_transformers_continuous_batching:
            return super()._generate_single_turn(*args, **kwargs)
        sampling = self.generation_config
        model = self.accelerator.unwrap_model(self.model)
        with rollout_generation(model, sampling, self.eos_token_ids, race=self.args.race_sampling) as config:
            self.generation_config = config
            try:
                return super()._generate_single_turn(*args, **kwargs)
            finally:
                self.generation_config = sampling

    # RLKV objective -------------------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # gathered over ranks already, so r_bar (and the penalty) is identical on every rank
        weights = self.reward_weights.to(rewards_per_func.device).unsqueeze(0)
        rewards = (rewards_per_func * weights).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        mode = "train" if self.model.training else "eval"
        self._mean_reward[mode] = torch.nanmean(rewards).item() if rewards.numel() else math.nan
        return rewards_per_func

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        mode = "train" if self.model.training else "eval"
        args: GateGRPOConfig = self.args
        r_bar = self._mean_reward[mode]
        weight = penalty_weight(r_bar, args.l1_beta, args.reward_threshold, args.adaptive_penalty)
        gates = self.accelerator.unwrap_model(model).rlkv_gates
        alpha = full_alpha(gates.alpha)
        scope = None
        if args.penalty_scope == "outside_target":
            scope = outside_target(alpha, gates.below_zero, args.target_sparsity)
        penalty = l1_penalty(alpha, weight, scope)
        # TRL divides its loss by the accumulation steps in training; the penalty is per optimizer step
        normalizer = self.current_gradient_accumulation_steps if mode == "train" else 1.0
        self._metrics[mode]["rlkv/r_bar"].append(r_bar)
        self._metrics[mode]["rlkv/beta_prime"].append(weight)
        self._metrics[mode]["rlkv/l1_penalty"].append(penalty.item())
        return loss + penalty.to(loss.dtype) / normalizer

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """Completion log-probs through `rlkv.trainers.logprobs` (text models; TRL's own path otherwise)."""
        if compute_aux_loss or any(v is not None for v in multimodal.values()):
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size=batch_size,
                compute_entropy=compute_entropy,
                compute_aux_loss=compute_aux_loss,
                **multimodal,
            )
        lm_head = self.accelerator.unwrap_model(model).get_output_embeddings()
        batch_size = batch_size or input_ids.size(0)
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            rows = slice(start, start + batch_size)
            with self.accelerator.autocast():
                lp, ent = completion_logps(
                    model,
                    lm_head,
                    input_ids[rows],
                    attention_mask[rows],
                    logits_to_keep,
                    temperature=self.temperature,
                    with_entropy=compute_entropy,
                )
            logps.append(lp)
            entropies.append(ent)
        return torch.cat(logps), torch.cat(entropies) if compute_entropy else None, None

    # logging --------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            alpha = full_alpha(self.gates.alpha)
            logs.update(gate_statistics(alpha, self.model.config, self.args.target_sparsity))
        super().log(logs, start_time)

    # checkpoints: the gates only ------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write the gates (gates.safetensors), config.json, head_mask.json/tsv and the training args.

        No tokenizer or chat template: a gate checkpoint is resumed and exported with the model's own
        tokenizer (its path is in gates.safetensors' metadata), and a copy costs ~11 MB per checkpoint.
        """
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        gates = self.gates
        alpha = full_alpha(gates.alpha)  # every rank: may be a collective
        if not self.args.should_save:
            return
        metadata = {**self._run_metadata, "global_step": self.state.global_step}
        config = self.accelerator.unwrap_model(self.model).config
        save_gate_checkpoint(output_dir, alpha, gates.sink, gates.local, config, metadata, gates.below_zero)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        alpha, _ = load_gate_checkpoint(resume_from_checkpoint)
        gates = self.accelerator.unwrap_model(model if model is not None else self.model).rlkv_gates
        if tuple(alpha.shape) != tuple(gates.alpha.shape):
            raise ValueError(
                f"{resume_from_checkpoint}: gates have shape {tuple(alpha.shape)}, this model needs "
                f"{tuple(gates.alpha.shape)}; resume with the model the checkpoint was trained on"
            )
        target = gates.alpha
        with torch.no_grad():
            from torch.distributed.tensor import DTensor, distribute_tensor

            if isinstance(target, DTensor):
                target.copy_(distribute_tensor(alpha.to(target.dtype), target.device_mesh, target.placements))
            else:
                target.copy_(alpha.to(device=target.device, dtype=target.dtype))
            below_zero = load_below_zero(resume_from_checkpoint)  # None: saved before it existed
            gates.below_zero.copy_(
                below_zero if below_zero is not None else torch.zeros_like(gates.below_zero)
            )
