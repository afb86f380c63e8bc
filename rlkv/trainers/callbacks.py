"""Gate statistics and the trainer callbacks: clamp the gates, export the head mask at every save.

The checkpoint files themselves are written and read by `rlkv.trainers.checkpoints`.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import TrainerCallback

from rlkv.gates.heads import full_alpha
from rlkv.head_mask import HeadMask
from rlkv.trainers.checkpoints import HEAD_MASK_JSON, HEAD_MASK_TSV


def gate_statistics(alpha: torch.Tensor, model_or_config: Any, target_sparsity: float) -> dict[str, float]:
    """What a researcher watches about the gates (clamped to [0, 1]).

    Returns mean/std/min/max, `above_0.5` (number of heads with alpha > 0.5), `mask_sparsity`
    (achieved fraction of compressed heads of the mask at `target_sparsity`: rounding makes it
    differ from the target) and `mask_margin` (lowest full-head gate minus highest compressed-head
    gate: how clearly the gates separate the two groups at that sparsity; NaN if one group is empty).
    """
    mask = HeadMask.from_gates(alpha, model_or_config)
    scores = mask.scores
    full = mask.full_heads(target_sparsity)
    n_full, n = int(full.sum()), scores.numel()
    margin = float(scores[full].min() - scores[~full].max()) if 0 < n_full < n else math.nan
    return {
        "gates/mean": float(scores.mean()),
        "gates/std": float(scores.std()) if n > 1 else 0.0,
        "gates/min": float(scores.min()),
        "gates/max": float(scores.max()),
        "gates/above_0.5": float((scores > 0.5).sum()),
        "gates/mask_sparsity": 1.0 - n_full / n,
        "gates/mask_margin": margin,
    }


def _gates_of(model: Any):
    gates = getattr(model, "rlkv_gates", None)
    if gates is None:
        raise ValueError("model has no rlkv_gates; build it with rlkv.attach_gates or GateGRPOTrainer")
    return gates


class GateClampCallback(TrainerCallback):
    """Projects the gates onto [0, 1] before training and after every optimizer step (authors: clamp).

    Clamping in place under no_grad after the step keeps autograd intact and means every forward
    (rollout generation and loss) sees gates in range.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        _gates_of(model).clamp_()

    def on_optimizer_step(self, args, state, control, model=None, **kwargs):
        _gates_of(model).clamp_()


class HeadMaskExportCallback(TrainerCallback):
    """Keeps `output_dir/head_mask.json` and `head_mask.tsv` current: refreshed at every save and at the end.

    (Each checkpoint directory gets its own copy from `GateGRPOTrainer.save_model`.)
    """

    def __init__(self, metadata: dict[str, Any] | None = None):
        self.metadata = dict(metadata or {})

    def _export(self, args, state, model) -> None:
        gates = _gates_of(model)
        alpha = full_alpha(gates.alpha)  # every rank: may be a collective
        if not state.is_world_process_zero:
            return
        config = model.config
        mask = HeadMask.from_gates(
            SimpleNamespace(alpha=alpha, sink=gates.sink, local=gates.local, below_zero=gates.below_zero),
            config,
            **{
                **self.metadata,
                "global_step": state.global_step,
            },  # the checkpoints' order: byte-equal copies
        )
        mask.save(Path(args.output_dir) / HEAD_MASK_JSON)
        mask.to_tsv(Path(args.output_dir) / HEAD_MASK_TSV)

    def on_save(self, args, state, control, model=None, **kwargs):
        self._export(args, state, model)

    def on_train_end(self, args, state, control, model=None, **kwargs):
        self._export(args, state, model)
