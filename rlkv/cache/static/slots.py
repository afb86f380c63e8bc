"""Where a `StaticHeadMixedLayer` (rlkv/cache/static/layer.py) writes its compressed heads' tokens.

The compressed slots of a layer are `[early | region]`: the early region holds each row's protected
prompt and sink (row b's first real token at slot `early_offset`, so rows line up as in the dynamic
cache's store), the region a ring of window + 1 slots (streaming) or the budget region
(rlkv/cache/static/budget.py). `write_prompt` fills them after prefill; `write_streaming` /
`write_budget` write one decode token with device indices only; `observe_prompt` hands a policy that
observes attention the prompt's own; `kept_per_head` counts, on the
host, how many tokens the dynamic cache keeps per compressed head at a given length.
"""

from __future__ import annotations

from typing import Protocol

import torch

from rlkv.cache.attention import EAGER_CHUNK_ELEMENTS
from rlkv.cache.settings import CompressionSettings
from rlkv.cache.static.budget import RowSchedule, StaticForm


class StaticHeadMixedLayer(Protocol):
    """What these functions read of a `rlkv.cache.static.layer.StaticHeadMixedLayer` (a protocol, so
    the layer can import this module and not the other way round)."""

    buffers: dict[str, torch.Tensor]
    num_groups: int  # query heads per KV head
    slot_view: object  # what the policy's `on_attention` gets as its store (per-slot buffers)
    slot_fills: dict[str, float]  # the policy's per-slot buffers (names in `buffers`) and fill values
    settings: CompressionSettings
    form: StaticForm
    compacted_at: int  # host length at the last compaction, -1 before any
    defer_positions: bool  # eager budget writes leave the written slots' positions to `flush_positions`
    deferred: tuple[int, int, int] | None  # (first slot, its column, count) of positions not yet written
    early: int  # early-region slots
    prompt_width: int
    host_length: int  # tokens stored, this forward's included
    sink_until: int  # streaming: the first column from which no row's decode token is a sink token
    shared_offset: int | None  # the `region_base` offset every row shares (host int), None when rows differ
    schedule: RowSchedule | None  # a budget region's compactions

    def early_needed(self, width: int) -> int: ...


def write_prompt(layer: StaticHeadMixedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Write the prompt's compressed-head keys/values [B, H_c, W, D] into the slots: the early region
    (each row's real tokens from slot early_offset on) and, streaming, the ring's last window tokens."""
    b = layer.buffers
    batch, heads, width, dim = keys.shape
    sink, window = layer.settings.sink, layer.settings.window
    device = keys.device
    start = b["row_start"]
    offset = layer.early - layer.early_needed(width)
    b["early_offset"].fill_(offset)
    if layer.form.kind == "budget" or layer.settings.protect_prompt:
        early_len = (width - start).clamp(min=sink if layer.form.kind == "streaming" else 0)
    else:
        early_len = torch.full_like(start, sink)
    b["early_len"].copy_(early_len)
    rel = torch.arange(layer.early, device=device) - offset
    cols = start[:, None] + rel
    positions = torch.where((rel >= 0) & (rel < early_len[:, None]) & (cols < width), cols, -1)
    if layer.form.kind == "streaming":
        ring = window + 1
        slot = torch.arange(ring, device=device)
        last = slot + ring * torch.div(width - 1 - slot, ring, rounding_mode="floor")  # newest col in slot
        keep = (last >= max(width - window, 0)) & (last >= start[:, None])
        keep &= (last - start[:, None]) >= early_len[:, None]  # a sink token lives in the early region
        positions = torch.cat([positions, torch.where(keep, last, -1)], dim=1)
    else:
        tail = torch.full((batch, layer.form.region_slots(window)), -1, device=device, dtype=torch.long)
        positions = torch.cat([positions, tail], dim=1)
    idx = positions.clamp(min=0)[:, None, :, None].expand(batch, heads, -1, dim)
    b["comp_k"].copy_(keys.gather(2, idx))
    b["comp_v"].copy_(values.gather(2, idx))
    b["comp_pos"].copy_(positions[:, None, :].expand(batch, heads, -1))


def _write_slot(
    b: dict[str, torch.Tensor],
    at: int,
    keys: torch.Tensor,
    values: torch.Tensor,
    column: int | None = None,
) -> None:
    """Eager decode write of every row's token [B, H_c, 1, D] at the host-known slot `at` (logical `column`;
    None: the position is written later)."""
    b["comp_k"].narrow(2, at, 1).copy_(keys)
    b["comp_v"].narrow(2, at, 1).copy_(values)
    if column is not None:
        b["comp_pos"].narrow(2, at, 1).fill_(column)


def written_run(layer: StaticHeadMixedLayer) -> tuple[int, int]:
    """(lo, hi): the budget slots of an unpadded batch whose rows share `shared_offset`, one run in the
    dynamic store's order: the prompt at [early - width, early) (an unprotected prompt's only until the
    first compaction packs the kept tokens from slot 0), then the kept and the newer generated tokens up
    to the one this forward wrote (`write_budget`'s slot + 1)."""
    lo = 0 if not layer.form.protect and layer.compacted_at >= 0 else layer.early - layer.prompt_width
    return lo, layer.early + layer.host_length - layer.prompt_width + layer.shared_offset


def flush_positions(layer: StaticHeadMixedLayer) -> None:
    """Write the positions eager steps left to later (`defer_positions`): consecutive slots hold
    consecutive columns, so one range serves them all. Called by the readers of the positions, a
    compaction and `kept_positions`; the steps that defer attend the written run without a mask, and
    a compaction that leaves rows unalike (no `shared_offset`) ends the deferring writes."""
    if layer.deferred is None:
        return
    slot, column, count = layer.deferred
    layer.deferred = None
    pos = layer.buffers["comp_pos"]
    pos.narrow(2, slot, count).copy_(torch.arange(column, column + count, dtype=pos.dtype, device=pos.device))


def write_streaming(
    layer: StaticHeadMixedLayer, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Decode write: the ring slot pos % (window + 1), and the early slot when the token is a sink token."""
    b = layer.buffers
    batch, heads, _, dim = keys.shape
    # a row's decode token is a sink token only while pos < row_start + sink: past that, in every row, an
    # eager step writes the host-known ring slot alone (a compiled step keeps one graph)
    if not torch.compiler.is_compiling() and layer.host_length > layer.sink_until:
        column = layer.host_length - 1
        _write_slot(b, layer.early + column % (layer.settings.window + 1), keys, values, column)
        return
    ring = (layer.early + pos % (layer.settings.window + 1)).view(1)
    b["comp_k"].index_copy_(2, ring, keys)
    b["comp_v"].index_copy_(2, ring, values)
    if not layer.early:
        b["comp_pos"].index_copy_(2, ring, pos.to(torch.int32).expand(batch, heads, 1))
        return
    early = (pos - b["row_start"]) < b["early_len"]  # [B]: the token belongs to the row's sink
    ring_pos = torch.where(early, -1, pos).to(torch.int32)[:, None, None].expand(batch, heads, 1)
    b["comp_pos"].index_copy_(2, ring, ring_pos)
    slot = (b["early_offset"] + pos - b["row_start"]).clamp(0, layer.early - 1)  # [B]
    idx = slot[:, None, None, None].expand(batch, heads, 1, dim)
    for name, new in (("comp_k", keys), ("comp_v", values)):
        old = b[name].gather(2, idx)
        b[name].scatter_(2, idx, torch.where(early[:, None, None, None], new, old))
    idx = idx[..., 0]
    old = b["comp_pos"].gather(2, idx)
    b["comp_pos"].scatter_(2, idx, torch.where(early[:, None, None], pos.to(torch.int32), old))


def write_budget(
    layer: StaticHeadMixedLayer, pos: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
) -> None:
    """Decode write: row b's generated token g at region slot g + `region_base[b]`, the device offset
    the last compaction set (the row's kept count - generated then; 0 before any), so it lands right
    after the row's kept run. An eager step whose rows share one offset writes one host-known slot."""
    b = layer.buffers
    batch, heads, _, dim = keys.shape
    if not torch.compiler.is_compiling() and layer.shared_offset is not None:
        column = layer.host_length - 1
        at = layer.early + column - layer.prompt_width + layer.shared_offset
        if not layer.defer_positions:
            _write_slot(b, at, keys, values, column)
        else:  # this step attends the written run, no mask: the position waits for the next reader
            _write_slot(b, at, keys, values)
            slot, first, count = layer.deferred or (at, column, 0)  # a compaction flushed the last run
            layer.deferred = (slot, first, count + 1)
        for name, fill in layer.slot_fills.items():
            b[name].narrow(2, at, 1).fill_(fill)
        return
    slot = (layer.early + pos - b["prompt_len"] + b["region_base"])[:, None, None].expand(batch, heads, 1)
    wide = slot[..., None].expand(batch, heads, 1, dim)
    b["comp_k"].scatter_(2, wide, keys)
    b["comp_v"].scatter_(2, wide, values)
    b["comp_pos"].scatter_(2, slot, pos.to(torch.int32).expand(batch, heads, 1))
    for name, fill in layer.slot_fills.items():  # the policy's per-slot values start afresh
        b[name].scatter_(2, slot, fill)


def observe_prompt(layer: StaticHeadMixedLayer, q_comp: torch.Tensor, scaling: float) -> None:
    """Hand the layer's policy the prompt's causal attention probabilities over the slots, [B, H_c, G, Q, S]
    in query chunks (an explicit fp32 softmax, as the dynamic cache's observing path); q_comp: the
    compressed heads' prompt queries [B, H_c * G, Q, D]."""
    b = layer.buffers
    batch, _, width, dim = q_comp.shape
    heads, slots = b["comp_k"].shape[1], b["comp_k"].shape[2]
    q = q_comp.reshape(batch, heads, layer.num_groups, width, dim)
    keys_t = b["comp_k"][:, :, None].float().transpose(-1, -2)
    pos = b["comp_pos"][:, :, None, None, :]  # [B, H_c, 1, 1, S]: a slot's column
    step = max(1, EAGER_CHUNK_ELEMENTS // max(1, batch * heads * layer.num_groups * slots))
    for start in range(0, width, step):
        cols = torch.arange(start, min(width, start + step), device=q.device)[:, None]
        logits = torch.matmul(q[:, :, :, start : start + step].float(), keys_t) * scaling
        allowed = (pos >= 0) & (pos <= cols)  # causal; a padding query sees no real key
        probs = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)
        layer.settings.policy.on_attention(layer.slot_view, probs)


def kept_per_head(layer: StaticHeadMixedLayer, length: int, row: int, row_start: int) -> int:
    """Tokens the dynamic cache keeps per compressed head of batch row `row`, starting at column
    `row_start`, once `length` columns were seen (host ints only: the static layout holds exactly
    these, plus the ring slot the next token overwrites)."""
    settings, form, width = layer.settings, layer.form, layer.prompt_width
    real = length - row_start
    if form.kind == "budget":  # held: evictable tokens (an unprotected prompt's among them)
        held = layer.schedule.held(length - width)[row]
        return width - row_start + held if form.protect else held
    early = max(settings.sink, width - row_start) if settings.protect_prompt else settings.sink
    recent_from = max(length - settings.window, row_start + early)
    return min(early, real) + max(0, length - recent_from)
