"""Teacher-forced batches: (prompt ids, completion ids) pairs left-padded into one forward's inputs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

Solution = tuple[list[int], list[int]]  # (prompt token ids, completion token ids)


@dataclass
class TeacherForcedBatch:
    """Left-padded inputs of B sequences of width T, and where their completion tokens are predicted.

    input_ids, attention_mask, position_ids: LongTensor[B, T] (positions count real tokens, as in
    `generate`); rows, cols: LongTensor[N], the N positions whose next-token distribution predicts a
    completion token (row-major, in token order); targets: LongTensor[N], those tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    targets: torch.Tensor

    def to(self, device: torch.device | str) -> TeacherForcedBatch:
        """The same batch with every tensor on `device`."""
        return TeacherForcedBatch(*(getattr(self, f).to(device) for f in self.__dataclass_fields__))


def teacher_forced_batch(sequences: list[Solution], pad_id: int = 0) -> TeacherForcedBatch:
    """Left-pad `sequences` (each with a non-empty completion) into a `TeacherForcedBatch`."""
    if not sequences or any(not completion for _, completion in sequences):
        raise ValueError("teacher_forced_batch needs sequences with non-empty completions")
    width = max(len(p) + len(c) for p, c in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(len(sequences), width, dtype=torch.long)
    rows, cols = [], []
    for row, (prompt, completion) in enumerate(sequences):
        ids = list(prompt) + list(completion)
        input_ids[row, width - len(ids) :] = torch.tensor(ids)
        attention_mask[row, width - len(ids) :] = 1
        rows += [row] * len(completion)
        cols += range(width - len(completion) - 1, width - 1)  # positions that predict the completion
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    return TeacherForcedBatch(
        input_ids, attention_mask, position_ids, rows_t, cols_t, input_ids[rows_t, cols_t + 1]
    )
