"""Attention that a token-eviction policy observes (H2O) in rlkv's vLLM eviction group: per-slot buffers.

A policy with `observe_attention` (H2O: the attention each kept slot has received) scores slots from the
attention probabilities of every query that saw them. On rlkv's transformers path the static cache hands
the policy those probabilities (an explicit fp32 softmax, `rlkv.cache.static.attention.observed_attention`
and `rlkv.cache.static.slots.observe_prompt`) and keeps the policy's per-slot buffers aligned with the
slots through compactions. Here the same, over vLLM's pages:

- `SlotTables`: each buffer the policy asks for (`slot_buffer(name, fill)`) is a per-layer table
  [request rows, KV heads, capacity] (rows as the eviction builder gives them; a prompt longer than the
  capacity keeps its buffers whole beside the table until its compaction); a slot is reset to the
  buffer's fill when a token is written there; a step's rows are gathered into a view for the policy's
  `on_attention` and written back after it; a compaction hands the gathered buffers to `keep_in_run`,
  which moves them with the kept slots.
- `prompt_probabilities` / `decode_attention`: the explicit fp32 softmax of the transformers path, for a
  prompt chunk (causal over the request's earlier slots) and, through `observed_attention` itself, for one
  generated token per request (over its occupied slots; the output computed from the same probabilities).
"""

from __future__ import annotations

from typing import Any

import torch

from rlkv.cache.static.attention import observed_attention


class SlotTables:
    """The per-slot buffers of one eviction layer's policy, [rows, H_kv, capacity] each, made when first asked.

    A prompt may be longer than the capacity (budget + slack) until its compaction: a request's buffers then
    live whole in `wide` (row -> name -> [H_kv, slots]) until the compaction keeps at most `capacity` slots.
    """

    def __init__(self, rows: int, heads: int, capacity: int, device: torch.device) -> None:
        self.shape, self.device = (rows, heads, capacity), device
        self.tables: dict[str, tuple[torch.Tensor, float]] = {}
        self.wide: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def capacity(self) -> int:
        """Slots per row in the tables (the layer's budget + slack, or max_model_len for a protected prompt)."""
        return self.shape[2]

    def reset(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill slots [N] of rows [N] (tokens are written there; slots < capacity) with each table's fill."""
        for table, fill in self.tables.values():
            table[rows, :, slots] = fill

    def view(self, rows: torch.Tensor, width: int, host_rows: list[int] | None = None) -> SlotView:
        """What `on_attention` gets for the requests in `rows` [B] over their first `width` slots (`host_rows`:
        the same rows on the host, needed when `width` exceeds the capacity)."""
        return SlotView(self, rows, width, host_rows)

    def table(self, name: str, fill: float, dtype: torch.dtype) -> torch.Tensor:
        """The table [rows, H_kv, capacity] of buffer `name`, made filled with `fill` when first asked."""
        if name not in self.tables:
            self.tables[name] = (torch.full(self.shape, fill, dtype=dtype, device=self.device), fill)
        return self.tables[name][0]


class SlotView:
    """`slot_buffer` over some rows' first `width` slots: gathered copies [B, H_kv, width], `store()`d back."""

    def __init__(
        self, tables: SlotTables, rows: torch.Tensor, width: int, host_rows: list[int] | None
    ) -> None:
        if width > tables.capacity and host_rows is None:
            raise ValueError("a view wider than the slot tables needs its rows on the host")
        self.tables, self.rows, self.width, self.host_rows = tables, rows, width, host_rows
        self.buffers: dict[str, tuple[torch.Tensor, float]] = {}
        for name, (_, fill) in tables.tables.items():
            self.buffers[name] = (self._gather(name, fill), fill)

    def _gather(self, name: str, fill: float) -> torch.Tensor:
        table = self.tables.tables[name][0]
        if self.width <= self.tables.capacity:
            return table[self.rows, :, : self.width]
        buf = torch.full(
            (self.rows.shape[0], *table.shape[1:2], self.width), fill, dtype=table.dtype, device=table.device
        )
        buf[:, :, : table.shape[2]] = table[self.rows]
        for i, row in enumerate(self.host_rows):
            wide = self.tables.wide.get(row, {}).get(name)
            if wide is not None:
                buf[i, :, : wide.shape[1]] = wide[:, : self.width]
        return buf

    def slot_buffer(self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The policy's per-slot buffer `name` for these rows (made, filled with `fill`, when first asked)."""
        if name not in self.buffers:
            self.tables.table(name, fill, dtype)
            self.buffers[name] = (self._gather(name, fill), fill)
        return self.buffers[name][0]

    def store(self, compacted: bool = False) -> None:
        """Write the (updated) buffers back: the first `capacity` slots into the tables, a prompt's wider ones
        whole until its compaction (`compacted`: each row now holds at most `capacity` slots)."""
        capacity = self.tables.capacity
        for name, (buf, _) in self.buffers.items():
            self.tables.tables[name][0][self.rows, :, : min(self.width, capacity)] = buf[:, :, :capacity]
            for i, row in enumerate(self.host_rows or ()):
                if compacted:
                    self.tables.wide.pop(row, None)
                elif self.width > capacity:
                    self.tables.wide.setdefault(row, {})[name] = buf[i].clone()


def prompt_probabilities(
    query: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float
) -> Any:
    """Causal attention probabilities [1, H_kv, G, Q, L] of a prompt chunk's queries [Q, H_q, D] at `positions`
    [Q] over a request's slots keys [H_kv, L, D] (slot = position), an explicit fp32 softmax."""
    count, heads, dim = query.shape
    kv_heads, length = keys.shape[0], keys.shape[1]
    q = query.transpose(0, 1).reshape(kv_heads, heads // kv_heads, count, dim).float()
    logits = torch.matmul(q, keys[:, None].float().transpose(-1, -2)) * scale  # [H_kv, G, Q, L]
    allowed = torch.arange(length, device=query.device)[None, :] <= positions[:, None]
    probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
    return probs[None]


def decode_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, occupied: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One generated token per request: query [W, H_q, D] over its slots keys, values [W, H_kv, S, D]
    (occupied BoolTensor [W, S]), the transformers path's `observed_attention`. Returns (output [W, H_q, D],
    probabilities [W, H_kv, G, 1, S])."""
    valid = occupied[:, None, :].expand(-1, keys.shape[1], -1)
    out, probs = observed_attention(query[:, :, None, :], keys, values, valid, scale)
    return out[:, 0], probs
