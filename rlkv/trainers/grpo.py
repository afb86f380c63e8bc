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
- with `beta > 0`, TRL's per-token KL term is taken against the full-attention model: the same
  model with its gates switched off (`rlkv.gates.full_attention`), never a second copy of the weights;
- checkpoints hold the gates only (`gates.safetensors` + config + head_mask.json/tsv) plus
  transformers' optimizer / scheduler / RNG / trainer state, and resume restores alpha exactly;
- gate statistics are added to every training log record.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from trl import GRPOTrainer
from trl.trainer.utils import create_model_from_path

from rlkv.compat import GATE_TRAINER_API, check_attributes, check_private_api
from rlkv.cpu_memory import keep_freed_memory
from rlkv.gates import full_attention
from rlkv.gates.heads import full_alpha
from rlkv.trainers.config import GateGRPOConfig
from rlkv.trainers.data_order import EpochSeededSampler
from rlkv.trainers.gate_trainer import (
    GateTrainerMixin,
    gate_callbacks,
    gate_penalty,
    gates_for,
    penalty_weight,
    set_cpu_threads,
)
from rlkv.trainers.logprobs import completion_logps
from rlkv.trainers.sampling import rollout_generation


class FullAttentionReference:
    """TRL's `ref_model` slot for RLKV: the trained model itself with its gates switched off.

    `GateGRPOTrainer._get_per_token_logps_and_entropies` recognises it and scores the policy model
    under `rlkv.gates.full_attention`, so the KL reference costs one forward and no memory.
    """


class GateGRPOTrainer(GateTrainerMixin, GRPOTrainer):
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
        gates_for(model, args)
        run_metadata = {
            "trainer": "rlkv.trainers.GateGRPOTrainer",
            "l1_beta": args.l1_beta,
            "reward_threshold": args.reward_threshold,
            "adaptive_penalty": args.adaptive_penalty,
            "target_sparsity": args.target_sparsity,
            "penalty_scope": args.penalty_scope,
            "kl_beta": args.beta,
            **({"gate_init_from": args.gate_init_from} if args.gate_init_from else {}),
        }
        callbacks = gate_callbacks(run_metadata, kwargs.pop("callbacks", None))
        set_cpu_threads(args.torch_threads)
        if args.use_cpu or not torch.cuda.is_available():
            keep_freed_memory()  # rollouts free and reallocate [B, vocabulary] tensors every step
        # TRL would load a second copy of the weights as its reference when beta > 0: build without it,
        # then point its reference slot at the gated model's own full attention
        beta, args.beta = args.beta, 0.0
        try:
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, callbacks=callbacks, **kwargs)
        finally:
            args.beta = beta
        check_attributes(self, GATE_TRAINER_API, feature="GateGRPOTrainer")
        self.beta = beta
        self.ref_model = FullAttentionReference() if beta != 0.0 else None
        self._run_metadata = run_metadata
        self._mean_reward = {"train": math.nan, "eval": math.nan}

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
        penalty = gate_penalty(alpha, gates.below_zero, weight, args.penalty_scope, args.target_sparsity)
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
        """Completion log-probs through `rlkv.trainers.logprobs` (text models; TRL's own path otherwise).

        `model` may be the `FullAttentionReference`: then the policy model scores them with its gates off.
        """
        if isinstance(model, FullAttentionReference):
            with torch.no_grad(), full_attention(self.accelerator.unwrap_model(self.model)):
                return self._get_per_token_logps_and_entropies(
                    self.model,
                    input_ids,
                    attention_mask,
                    logits_to_keep,
                    batch_size=batch_size,
                    compute_entropy=compute_entropy,
                    compute_aux_loss=compute_aux_loss,
                    **multimodal,
                )
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
