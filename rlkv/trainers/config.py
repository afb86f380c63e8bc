"""`GateGRPOConfig`: TRL's `GRPOConfig` with RLKV's gate and penalty fields and the paper's defaults."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig

from rlkv.compat import activation_checkpointing_field


@dataclass
class GateGRPOConfig(GRPOConfig):
    """GRPO settings for training RLKV head gates (only the L x H_kv gates train; the model is frozen).

    RLKV fields (docs/design.md, "Training"): the L1 penalty added to the loss is
    `beta' * mean(|alpha|)` = `beta' / (L * H) * ||alpha||_1` with
    `beta' = 1[r_bar > reward_threshold] * l1_beta * (exp(r_bar) - 1)` when `adaptive_penalty`,
    else the constant `l1_beta`. `r_bar` is the mean raw reward of the step's generation batch.

    Defaults that differ from TRL follow the paper (Table 3) and the authors' code: 4 generations,
    lr 1e-2 constant, weight decay 0.017, clip epsilon 0.4, no KL (beta 0), 7168 new tokens,
    per-sequence loss aggregation ("grpo"). bf16 defaults to on only when CUDA is available;
    activation (gradient) checkpointing defaults to off. Several ranks on a machine without accelerators
    (`accelerate launch --multi_gpu --num_processes N` on CPU) get `use_cpu` so they run DDP over gloo.
    """

    l1_beta: float = field(
        default=1e-3, metadata={"help": "Base weight beta of the L1 penalty on the gates."}
    )
    reward_threshold: float = field(
        default=0.5,
        metadata={"help": "tau: the penalty is exactly 0 while the step's mean reward r_bar <= tau."},
    )
    adaptive_penalty: bool = field(
        default=True,
        metadata={
            "help": "Scale beta by 1[r_bar > tau] * (exp(r_bar) - 1); False = constant l1_beta (ablation)."
        },
    )
    torch_threads: int = field(
        default=0,
        metadata={
            "help": "CPU threads for torch in each rank; 0 = the machine's cores divided by the ranks on it "
            "(`accelerate launch` otherwise sets OMP_NUM_THREADS=1 and one core does all the work)."
        },
    )
    race_sampling: bool = field(
        default=True,
        metadata={
            "help": "Sample rollouts by the exponential race (rlkv.trainers.sampling): the same distribution as "
            "transformers' sampling without torch.multinomial, a third of a CPU decode step at 150K vocab."
        },
    )
    gate_sink: int = field(default=128, metadata={"help": "Sink tokens of the local branch during training."})
    gate_local: int = field(
        default=256, metadata={"help": "Local-window tokens of the local branch during training."}
    )
    gate_init: float = field(
        default=1.0,
        metadata={
            "help": "Initial gate value in [0, 1] (1 = full attention); with gate_init_from, the most important "
            "head's."
        },
    )
    gate_init_from: str | None = field(
        default=None,
        metadata={
            "help": "A head mask whose ranking sets the initial gates (anything HeadMask.from_pretrained reads, e.g. "
            "the folder `rlkv ablation-mask` wrote): its most important head starts at gate_init, its least "
            "important at gate_init_low, the others evenly spaced by rank between. Default: every gate at gate_init."
        },
    )
    gate_init_low: float = field(
        default=0.5,
        metadata={
            "help": "With gate_init_from: the initial gate of the mask's least important head (<= gate_init)."
        },
    )
    penalty_scope: str = field(
        default="all",
        metadata={
            "help": "Which gates the L1 term pushes down: 'all' (RLKV, DuoAttention); 'outside_target': only the "
            "heads outside the current top round((1 - target_sparsity) * L * H) by gate value (ties by "
            "HeadGates.below_zero), so the heads the deployed mask keeps full are ranked by reward alone; "
            "'budget': every gate, but only while mean(alpha) > 1 - target_sparsity (the deployed mask's share of "
            "full heads), so at the budget the objective alone decides which heads rise and which fall."
        },
    )
    gate_forward: str = field(
        default="soft",
        metadata={
            "help": "What the training forward runs: 'soft' (RLKV, DuoAttention: each head mixes full and sink+local "
            "attention by its gate); 'hard' (the mask at target_sparsity: the top round((1 - target_sparsity) * L * H) "
            "gates at 1, the rest at 0, with the soft gates' gradient, straight-through), so the loss is that of "
            "the layout a deployment uses and the gradient says which swap at its cut would help."
        },
    )
    objective: str = field(
        default="grpo",
        metadata={
            "help": "What trains the gates: 'grpo' (RLKV: rewards on the gated model's own rollouts); 'distill' "
            "(the dataset's `completion` column, e.g. a self-distilled curriculum, teacher-forced through the gated "
            "model: KL(full attention || gated) per completion token, no generation in the step); 'distill+grpo' "
            "(distill_steps of distillation into output_dir/distill, then GRPO from those gates)."
        },
    )
    distill_steps: int = field(
        default=60,
        metadata={"help": "Optimizer steps of the distillation stage of objective 'distill+grpo'."},
    )
    distill_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of distillation (default: learning_rate)."},
    )
    distill_max_length: int = field(
        default=2048,
        metadata={
            "help": "Distillation: prompt + completion tokens kept per sequence (longer ones are cut)."
        },
    )
    distill_top_fraction: float = field(
        default=1.0,
        metadata={
            "help": "Distillation: the loss keeps KL(full || gated) of this fraction of a batch's completion tokens, "
            "those with the largest KL, summed over all its tokens (1.0: the mean over every token; 0.1: the tenth "
            "where the gated model departs most from full attention, so a head that matters on few decisive "
            "tokens is not outvoted by the many easy ones; on the mean's scale, so l1_beta keeps its meaning). "
            "The logged distill/kl stays the mean over every token."
        },
    )
    target_sparsity: float = field(
        default=0.5,
        metadata={
            "help": "Fraction of KV heads compressed by the exported mask; used for logging and metadata."
        },
    )

    # paper / authors' defaults overriding TRL's
    learning_rate: float = field(default=1e-2, metadata={"help": "AdamW learning rate of the gates."})
    weight_decay: float = field(default=0.017, metadata={"help": "AdamW weight decay of the gates."})
    lr_scheduler_type: str = field(default="constant", metadata={"help": "Learning-rate schedule."})
    num_generations: int | None = field(default=4, metadata={"help": "Completions sampled per prompt (G)."})
    max_completion_length: int | None = field(
        default=7168, metadata={"help": "Maximum new tokens per completion."}
    )
    epsilon: float = field(
        default=0.4, metadata={"help": "Clip range of the importance ratio (authors: 0.4)."}
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "Weight of TRL's per-token KL(gated || full attention) on the rollouts; the reference is the "
            "same model with its gates off (no second copy). 0 (RLKV's default): no KL term."
        },
    )
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "TRL loss aggregation; 'grpo' = per-sequence token mean, then mean over sequences."
        },
    )
    logging_steps: float = field(default=1, metadata={"help": "Log every N optimizer steps."})
    gradient_checkpointing: bool | None = field(
        default=None, metadata={"help": "Deprecated alias of activation_checkpointing (transformers 5)."}
    )
    activation_checkpointing: bool | None = field(
        default=None, metadata={"help": "Recompute activations in backward (memory for time); default off."}
    )
    bf16: bool | None = field(default=None, metadata={"help": "bf16 mixed precision; default: on iff CUDA."})

    def __post_init__(self) -> None:
        if self.activation_checkpointing is None and self.gradient_checkpointing is None:
            self.activation_checkpointing = False
        if (
            activation_checkpointing_field() == "gradient_checkpointing"
            and self.gradient_checkpointing is None
        ):
            # transformers < 5.20 reads only gradient_checkpointing
            self.gradient_checkpointing = bool(self.activation_checkpointing)
        engine = _requested_sharding_engine()
        if engine and not torch.accelerator.is_available():
            # accelerate selects FSDP / DeepSpeed only on an accelerator: on CPU ranks it would silently run
            # plain DDP over gloo (use_cpu), let each rank train alone, or (one process) train unsharded
            raise ValueError(
                f"the accelerate config asks for {engine}, but this machine has no accelerator and accelerate "
                f"runs {engine} only on GPUs (on CPU it would silently run without it); on CPU use "
                "recipes/accelerate/multi_process_cpu.yaml (DDP over gloo) or single_process.yaml"
            )
        if (
            not self.use_cpu
            and int(os.environ.get("WORLD_SIZE", "1")) > 1
            and not torch.accelerator.is_available()
        ):
            # several ranks on a machine without accelerators: without use_cpu transformers would not set up
            # distributed training (each rank would train alone); with it, the ranks run DDP over gloo
            self.use_cpu = True
        if self.bf16 is None:
            self.bf16 = torch.cuda.is_available() and not self.fp16
        _check_range("l1_beta", self.l1_beta, 0.0, math.inf, "a non-negative penalty weight such as 1e-3")
        _check_range(
            "distill_top_fraction", self.distill_top_fraction, 1e-9, 1.0, "a fraction in (0, 1], e.g. 0.1"
        )
        _check_range("reward_threshold", self.reward_threshold, -math.inf, math.inf, "a finite reward level")
        _check_range("gate_init", self.gate_init, 0.0, 1.0, "a value in [0, 1]")
        # the low end of a ranked start only has to sit below gate_init when there is a ranking to spread
        low_end = self.gate_init if self.gate_init_from else 1.0
        _check_range("gate_init_low", self.gate_init_low, 0.0, low_end, f"a value in [0, {low_end}]")
        if self.penalty_scope not in PENALTY_SCOPES:
            raise ValueError(
                f"penalty_scope={self.penalty_scope!r} is invalid: use one of {', '.join(map(repr, PENALTY_SCOPES))}"
            )
        _check_range("target_sparsity", self.target_sparsity, 0.0, 1.0, "a fraction of heads in [0, 1]")
        if self.gate_forward not in GATE_FORWARDS:
            raise ValueError(
                f"gate_forward={self.gate_forward!r} is invalid: use one of {', '.join(map(repr, GATE_FORWARDS))}"
            )
        if self.objective not in OBJECTIVES:
            raise ValueError(
                f"objective={self.objective!r} is invalid: use one of {', '.join(map(repr, OBJECTIVES))}"
            )
        if self.distill_learning_rate is not None:
            _check_range(
                "distill_learning_rate", self.distill_learning_rate, 0.0, math.inf, "a learning rate > 0"
            )
        if getattr(self, "sync_ref_model", False):
            raise ValueError(
                "sync_ref_model=true has nothing to sync: the KL reference is the gated model itself with its "
                "gates off; set sync_ref_model to false"
            )
        if self.use_vllm:
            raise ValueError(
                "use_vllm=True samples rollouts from vLLM's copy of the model, which has no gates; RLKV's rollouts "
                "must come from the gated model itself: set use_vllm to false"
            )
        _check_counts(self)
        super().__post_init__()


PENALTY_SCOPES = ("all", "outside_target", "budget")
OBJECTIVES = ("grpo", "distill", "distill+grpo")
GATE_FORWARDS = ("soft", "hard")


def _requested_sharding_engine() -> str | None:
    """ "FSDP" / "DeepSpeed" when `accelerate launch` was given such a config (it sets these variables)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        return "FSDP"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true":
        return "DeepSpeed"
    return None


def _check_range(name: str, value: float, low: float, high: float, what: str) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or not low <= value <= high
    ):
        raise ValueError(f"{name}={value!r} is invalid: use {what}")


# (field, smallest value, None allowed): integer settings TRL would otherwise divide by, compare or
# iterate with, and fail on with ZeroDivisionError / TypeError instead of naming the field
_COUNT_FIELDS = (
    ("num_generations", 1, True),
    ("per_device_train_batch_size", 1, False),
    ("per_device_eval_batch_size", 1, False),
    ("gradient_accumulation_steps", 1, False),
    ("generation_batch_size", 1, True),
    ("steps_per_generation", 1, True),
    ("max_completion_length", 1, True),
    ("max_prompt_length", 1, True),
    ("max_steps", -1, False),
    ("seed", 0, False),
    ("torch_threads", 0, False),
    ("gate_sink", 0, False),
    ("gate_local", 1, False),
    ("distill_steps", 1, False),
    ("distill_max_length", 2, False),
)
_NUMBER_FIELDS = (
    "learning_rate",
    "weight_decay",
    "num_train_epochs",
    "logging_steps",
    "save_steps",
    "epsilon",
    "beta",
)


def _check_counts(config: GateGRPOConfig) -> None:
    """Raise ValueError naming the first count that is not an integer in range, or number that is not >= 0."""
    for name, low, optional in _COUNT_FIELDS:
        if not hasattr(config, name):
            continue  # a field this TRL version does not have
        value = getattr(config, name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            allowed = f"an integer >= {low}" + (" or null" if optional else "")
            raise ValueError(f"{name}={value!r} is invalid: use {allowed}")
    for name in _NUMBER_FIELDS:
        if hasattr(config, name) and getattr(config, name) is not None:
            _check_range(name, getattr(config, name), 0.0, sys.float_info.max, "a finite number >= 0")
