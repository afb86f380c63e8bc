"""Per-step tensors in buffers made once, so that a captured CUDA graph reads each step's at fixed addresses.

A metadata builder that hands the platform's kernel tensors it computes per step (read lengths, a remapped block
table, write slots) copies them into these buffers rather than handing fresh tensors: a graph captured over
one step's tensors would otherwise read that step's values at every replay.
"""

from __future__ import annotations

import torch


class PersistentReads:
    """Buffers of a builder's per-step kernel inputs: read lengths [max_num_seqs] (int32, vLLM's), a read table
    [max_num_seqs, width] (made at the first step that needs one) and write slots [max_num_batched_tokens]."""

    def __init__(self, requests: int, tokens: int, device: torch.device):
        self.read_lens = torch.zeros(requests, dtype=torch.int32, device=device)
        self.read_table: torch.Tensor | None = None
        self.write_slots = torch.full((tokens,), -1, dtype=torch.int64, device=device)

    def lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        """`lengths` [R] copied into the read lengths; their view."""
        out = self.read_lens[: lengths.shape[0]]
        out.copy_(lengths)
        return out

    def table(self, table: torch.Tensor) -> torch.Tensor:
        """`table` [R, C] copied into the read table; its view."""
        reqs, width = table.shape
        if self.read_table is None or self.read_table.shape[1] < width:
            self.read_table = torch.zeros(
                self.read_lens.shape[0], width, dtype=table.dtype, device=self.read_lens.device
            )
        out = self.read_table[:reqs, :width]
        out.copy_(table)
        return out

    def slots(self, slots: torch.Tensor) -> torch.Tensor:
        """`slots` [T] copied into the write slots; their view."""
        out = self.write_slots[: slots.shape[0]]
        out.copy_(slots)
        return out

    def storages(self) -> set[int]:
        """The data pointers of the buffers' storages (what a test checks the kernel's inputs against)."""
        buffers = (self.read_lens, self.read_table, self.write_slots)
        return {t.untyped_storage().data_ptr() for t in buffers if t is not None}
