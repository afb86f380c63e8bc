"""What every RLKV gate trainer shares, whatever its objective (GRPO, distillation).

`GateTrainerMixin` goes before a transformers / TRL trainer class: gates-only checkpoints
(`gates.safetensors` + config + head_mask.json/tsv, and transformers' optimizer / scheduler / RNG /
trainer state) that resume alpha exactly, gate statistics in every training log record, and the
gate penalty. The penalty functions (`l1_penalty`, the scopes of `gate_penalty`) live here too.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch

from rlkv.gates import attach_gates
from rlkv.gates.heads import full_alpha
from rlkv.head_mask import HeadMask, rank_heads
from rlkv.trainers.callbacks import GateClampCallback, HeadMaskExportCallback, gate_statistics
from rlkv.trainers.checkpoints import load_below_zero, load_gate_checkpoint, save_gate_checkpoint
from rlkv.trainers.config import PENALTY_SCOPES

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


def budget_penalty(alpha: torch.Tensor, weight: float, target_sparsity: float) -> torch.Tensor:
    """`weight * max(0, mean(|alpha|) - (1 - target_sparsity))`: the L1 push acts only while the gates
    hold more than the deployed mask's budget of full heads; at the budget the objective alone decides
    which gates rise and which fall (a knapsack over heads, not a race against a constant push)."""
    return weight * torch.relu(alpha.abs().mean() - (1.0 - target_sparsity))


def gate_penalty(
    alpha: torch.Tensor, below_zero: torch.Tensor, weight: float, scope: str, target_sparsity: float
) -> torch.Tensor:
    """The sparsity term of `scope` (one of `PENALTY_SCOPES`, see `GateGRPOConfig.penalty_scope`)."""
    if scope == "all":
        return l1_penalty(alpha, weight)
    if scope == "outside_target":
        return l1_penalty(alpha, weight, outside_target(alpha, below_zero, target_sparsity))
    if scope == "budget":
        return budget_penalty(alpha, weight, target_sparsity)
    raise ValueError(f"penalty_scope={scope!r} is invalid: use one of {', '.join(map(repr, PENALTY_SCOPES))}")


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


def gates_for(model: Any, args: Any) -> Any:
    """The model's `rlkv_gates`, attached (sink/local/init from `args`, a `GateGRPOConfig`) if it has none.

    Raises ValueError when the model's gates disagree with `args` or `gate_init_from` would be ignored.
    """
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
    if args.gate_forward == "hard":
        gates.hard_keep = round((1.0 - args.target_sparsity) * gates.alpha.numel())
    trainable = [name for name, p in model.named_parameters() if p.requires_grad]
    if trainable != ["rlkv_gates.alpha"]:
        raise ValueError(f"only rlkv_gates.alpha may be trainable, found trainable parameters {trainable}")
    return gates


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


def gate_callbacks(metadata: dict[str, Any], callbacks: list | None) -> list:
    """The caller's callbacks plus the gate clamp and the head-mask export."""
    return [*(callbacks or []), GateClampCallback(), HeadMaskExportCallback(metadata)]


class GateTrainerMixin:
    """Gate-only checkpoints, gate statistics in the logs; put it before the trainer class it extends.

    The subclass sets `self._run_metadata` (recorded in every checkpoint's head mask) in `__init__`.
    """

    _run_metadata: dict[str, Any]

    @property
    def gates(self):
        """The `HeadGates` module of the (unwrapped) model."""
        return self.accelerator.unwrap_model(self.model).rlkv_gates

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.model.training:
            alpha = full_alpha(self.gates.alpha)
            logs.update(gate_statistics(alpha, self.model.config, self.args.target_sparsity))
        super().log(logs, start_time)

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
