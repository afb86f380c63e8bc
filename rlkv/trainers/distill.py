"""`GateDistillTrainer`: the gates learned by distillation from the full-attention model, no generation.

Each step teacher-forces B of the dataset's completions (a self-distilled curriculum: the model's
own full-attention solutions) through the gated model and minimises the mean per-token
KL(full attention || gated) of the next-token distributions, plus the gate penalty
(`penalty_scope`, constant weight `l1_beta`). The reference is the same model with its gates off
(`rlkv.gates.full_attention`). The reference does not change during training, so each sequence's
reference hidden states are computed once, at its first batch, and kept (N x hidden size per
sequence, in the model's dtype: 0.4 MB for a 240-token solution of a 0.5B model in bf16); a step
then costs one forward with gradients and the backward to the gates. Built on transformers'
`Trainer`: checkpoints, resume, schedules and logging are its own; the checkpoints hold the gates
only, as GRPO's do.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from transformers import AutoModelForCausalLM, Trainer

from rlkv.cpu_memory import keep_freed_memory
from rlkv.data.batches import Solution, TeacherForcedBatch, teacher_forced_batch
from rlkv.gates.heads import full_alpha
from rlkv.trainers.config import GateGRPOConfig
from rlkv.trainers.distill_loss import distill_kl, reference_hidden, top_fraction_kl
from rlkv.trainers.gate_trainer import (
    GateTrainerMixin,
    gate_callbacks,
    gate_penalty,
    gates_for,
    set_cpu_threads,
)

logger = logging.getLogger(__name__)


def distill_sequences(dataset: Any, tokenizer: Any, max_length: int) -> list[Solution]:
    """(prompt ids, completion ids + EOS) of each row's `prompt` and `completion` (a curriculum's columns).

    A sequence longer than `max_length` keeps its prompt and the first part of its completion; rows
    whose prompt leaves no room, or whose completion is empty, are left out (logged).
    Raises ValueError when the dataset has no `completion` column or nothing is left.
    """
    columns = getattr(dataset, "column_names", None) or (list(dataset[0]) if len(dataset) else [])
    if "prompt" not in columns or "completion" not in columns:
        raise ValueError(
            f"objective 'distill' needs `prompt` and `completion` columns (found {columns}): train on a "
            "self-distilled curriculum (`rlkv data curriculum ... --out DIR`, then dataset_name: DIR)"
        )
    eos = tokenizer.eos_token_id
    sequences, skipped = [], 0
    for row in dataset:
        prompt = tokenizer(row["prompt"])["input_ids"]
        completion = tokenizer(row["completion"], add_special_tokens=False)["input_ids"]
        completion = (completion + ([eos] if eos is not None else []))[: max_length - len(prompt)]
        if not completion:
            skipped += 1
            continue
        sequences.append((prompt, completion))
    if skipped:
        logger.warning("distillation: %d rows left out (empty completion or prompt >= max length)", skipped)
    if not sequences:
        raise ValueError(f"distillation: no usable sequence (distill_max_length={max_length}); raise it")
    return sequences


def collate_sequences(items: list[tuple[int, Solution]]) -> dict[str, torch.Tensor]:
    """(index, sequence) items as the dict of tensors the Trainer moves to the device: a
    `TeacherForcedBatch`'s fields plus `index`, LongTensor[B], the sequences' places in the dataset."""
    batch = teacher_forced_batch([sequence for _, sequence in items])
    return {
        "index": torch.tensor([i for i, _ in items]),
        **{name: getattr(batch, name) for name in TeacherForcedBatch.__dataclass_fields__},
    }


class GateDistillTrainer(GateTrainerMixin, Trainer):
    """Distillation of the gates from the full-attention model (see the module docstring).

    model: a path / Hub id (loaded with `args.model_init_kwargs`) or a `PreTrainedModel`; gates are
    attached from `args` unless it carries them. train_dataset: (prompt ids, completion ids) pairs
    (`distill_sequences`). args: a `GateGRPOConfig` (its GRPO-only fields are ignored).
    """

    def __init__(
        self,
        model: Any,
        args: GateGRPOConfig,
        train_dataset: list[Solution],
        processing_class: Any = None,
        callbacks: list | None = None,
    ):
        if not isinstance(args, GateGRPOConfig):
            raise TypeError(f"args must be a rlkv.trainers.GateGRPOConfig, got {type(args).__name__}")
        if not train_dataset:
            raise ValueError(
                "train_dataset is empty: distillation needs (prompt, completion) token sequences"
            )
        if isinstance(model, str):
            model = AutoModelForCausalLM.from_pretrained(model, **(args.model_init_kwargs or {}))
        gates_for(model, args)
        self._run_metadata = {
            "trainer": "rlkv.trainers.GateDistillTrainer",
            "objective": "distill",
            "l1_beta": args.l1_beta,
            "target_sparsity": args.target_sparsity,
            "penalty_scope": args.penalty_scope,
            **({"gate_init_from": args.gate_init_from} if args.gate_init_from else {}),
        }
        set_cpu_threads(args.torch_threads)
        if args.use_cpu or not torch.cuda.is_available():
            keep_freed_memory()  # each step frees and reallocates [chunk, vocabulary] tensors
        super().__init__(
            model=model,
            args=args,
            train_dataset=list(enumerate(train_dataset)),
            data_collator=collate_sequences,
            processing_class=processing_class,
            callbacks=gate_callbacks(self._run_metadata, callbacks),
        )
        self.model_accepts_loss_kwargs = False  # the Trainer divides our loss by the accumulation steps
        self._step_metrics: dict[str, list[float]] = defaultdict(list)
        self._reference: dict[int, torch.Tensor] = {}  # dataset index -> reference hidden states [n_i, H]

    def _reference_hidden(self, model, gated, index: list[int], batch: TeacherForcedBatch) -> torch.Tensor:
        """The batch's reference hidden states [N, H], from the kept ones or one forward (then kept)."""
        if any(i not in self._reference for i in index):
            ref = reference_hidden(model, gated, batch)
            counts = torch.bincount(batch.rows, minlength=len(index)).tolist()
            for i, part in zip(index, ref.split(counts), strict=True):
                self._reference.setdefault(i, part.clone())
            return ref
        return torch.cat([self._reference[i] for i in index])  # rows are row-major, as in the batch

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        index = inputs.pop("index").tolist()
        batch = TeacherForcedBatch(**inputs)
        gated = self.accelerator.unwrap_model(model)
        ref = self._reference_hidden(model, gated, index, batch)
        token_kl = distill_kl(model, gated, batch, ref)
        kl = token_kl.mean()
        gates = gated.rlkv_gates
        args: GateGRPOConfig = self.args
        objective = top_fraction_kl(token_kl, args.distill_top_fraction)
        penalty = gate_penalty(
            full_alpha(gates.alpha), gates.below_zero, args.l1_beta, args.penalty_scope, args.target_sparsity
        )
        self._step_metrics["distill/kl"].append(kl.item())
        if args.distill_top_fraction < 1.0:
            self._step_metrics["distill/top_fraction_kl"].append(objective.item())
        self._step_metrics["rlkv/l1_penalty"].append(penalty.item())
        loss = objective + penalty.to(kl.dtype)
        return (loss, {"kl": kl}) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        for name, values in self._step_metrics.items():
            if values:
                logs[name] = sum(values) / len(values)
        self._step_metrics.clear()
        super().log(logs, start_time)
