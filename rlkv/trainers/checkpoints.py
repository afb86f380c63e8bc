"""Gate checkpoint files: write them, read them, rebuild the head mask from them.

A gate checkpoint directory holds `gates.safetensors` (tensor `alpha` [L, H_kv], tensor
`below_zero` [L, H_kv] (`HeadGates.below_zero`, absent before it existed), plus sink/local and the
model's name in the metadata), the model's `config.json`, and `head_mask.json` /
`head_mask.tsv` (the exported `HeadMask`). Only the gates are saved, never the frozen weights.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, PretrainedConfig

from rlkv.head_mask import TIE_BREAK_BELOW_ZERO, HeadMask, HeadMaskError, ModelFingerprint

GATES_FILE = "gates.safetensors"
HEAD_MASK_JSON = "head_mask.json"
HEAD_MASK_TSV = "head_mask.tsv"
OPTIMIZER_FILE = "optimizer.pt"  # transformers' Trainer writes it into every checkpoint-N
TIE_BREAK_PENDING_STEP = (
    "optimizer.pt: the AdamW step the optimizer would take next (checkpoints from before gates.below_zero)"
)
_CHECKPOINT_NAME = re.compile(r"^checkpoint-(\d+)$")


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """N of a Trainer checkpoint folder named `checkpoint-N` (None for any other name)."""
    found = _CHECKPOINT_NAME.match(Path(path).name)
    return int(found.group(1)) if found else None


def save_gate_checkpoint(
    directory: str | os.PathLike,
    alpha: torch.Tensor,
    sink: int,
    local: int,
    config: PretrainedConfig,
    metadata: dict[str, Any] | None = None,
    below_zero: torch.Tensor | None = None,
) -> HeadMask:
    """Write gates.safetensors, config.json, head_mask.json and head_mask.tsv into `directory` (atomically).

    Returns the exported `HeadMask` (scores = alpha clamped to [0, 1]; tie-break = `below_zero`,
    the gates' `HeadGates.below_zero`, when given).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alpha = alpha.detach().float().cpu().contiguous()
    tensors = {"alpha": alpha}
    if below_zero is not None:
        tensors["below_zero"] = below_zero.detach().float().cpu().contiguous()
    name = str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    tmp = directory / f".{GATES_FILE}.tmp"
    save_file(
        tensors,
        str(tmp),
        metadata={"format": "rlkv-gates", "sink": str(sink), "local": str(local), "model_name_or_path": name},
    )
    os.replace(tmp, directory / GATES_FILE)
    config.save_pretrained(directory)
    gates = SimpleNamespace(alpha=alpha, sink=sink, local=local, below_zero=tensors.get("below_zero"))
    mask = HeadMask.from_gates(gates, config, **(metadata or {}))
    mask.save(directory / HEAD_MASK_JSON)
    mask.to_tsv(directory / HEAD_MASK_TSV)
    return mask


def load_gate_checkpoint(directory: str | os.PathLike) -> tuple[torch.Tensor, dict[str, str]]:
    """Read `gates.safetensors` from a checkpoint directory: (alpha FloatTensor[L, H_kv], metadata)."""
    tensors, metadata = _read_gates_file(directory)
    return tensors["alpha"], metadata


def load_below_zero(directory: str | os.PathLike) -> torch.Tensor | None:
    """`HeadGates.below_zero` [L, H_kv] saved in a checkpoint's gates.safetensors (None: saved before it existed)."""
    return _read_gates_file(directory)[0].get("below_zero")


def checkpoint_tie_break(directory: str | os.PathLike) -> tuple[torch.Tensor, str] | None:
    """The tie-break of a checkpoint's head mask and where it came from (`HeadMask.tie_break`), or None.

    `below_zero` from gates.safetensors when saved; otherwise, for checkpoints written before it
    existed, the step AdamW would take next from the checkpoint's optimizer.pt (bias-corrected first
    moment over the root of the second, times -lr; weight decay is 0 on a gate at 0): the recent
    push on each gate, which for gates clamped to 0 says how hard the loss pushes them further down.
    """
    below_zero = load_below_zero(directory)
    if below_zero is not None:
        return below_zero, TIE_BREAK_BELOW_ZERO
    path = Path(directory) / OPTIMIZER_FILE
    if not path.is_file():
        return None
    saved = torch.load(path, map_location="cpu", weights_only=True)
    states = [s for s in saved.get("state", {}).values() if "exp_avg" in s and "exp_avg_sq" in s]
    if len(states) != 1 or not saved.get("param_groups"):
        return None  # not the gates-only AdamW of GateGRPOTrainer
    state, group = states[0], saved["param_groups"][0]
    step = float(state["step"])
    beta1, beta2 = group["betas"]
    first = state["exp_avg"].float() / (1.0 - beta1**step)
    second = state["exp_avg_sq"].float() / (1.0 - beta2**step)
    return -group["lr"] * first / (second.sqrt() + group["eps"]), TIE_BREAK_PENDING_STEP


def _read_gates_file(directory: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor of a checkpoint's gates.safetensors (checked: `alpha` is 2-D) and its metadata."""
    path = Path(directory) / GATES_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory}: no {GATES_FILE}; expected a checkpoint written by rlkv's GateGRPOTrainer "
            "(output_dir/checkpoint-N or output_dir itself after training)"
        )
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
    tensors = load_file(str(path))
    if "alpha" not in tensors or tensors["alpha"].dim() != 2:
        raise HeadMaskError(f"{path}: expected one 2-D tensor named 'alpha' ([layers, kv_heads])")
    extra = tensors.get("below_zero")
    if extra is not None and extra.shape != tensors["alpha"].shape:
        raise HeadMaskError(
            f"{path}: tensor 'below_zero' must have alpha's shape {tuple(tensors['alpha'].shape)}"
        )
    return tensors, metadata


def head_mask_from_checkpoint(directory: str | os.PathLike, **metadata: Any) -> HeadMask:
    """Rebuild the `HeadMask` of a gate checkpoint from its gates.safetensors and config.json."""
    alpha, meta = load_gate_checkpoint(directory)
    config = AutoConfig.from_pretrained(directory)
    fingerprint = ModelFingerprint.of(config)
    if meta.get("model_name_or_path"):
        fingerprint = dataclasses.replace(fingerprint, name_or_path=meta["model_name_or_path"])
    tie_break = checkpoint_tie_break(directory)
    source = {} if tie_break is None else {"tie_break": tie_break[1]}
    return HeadMask(
        scores=alpha.clamp(0.0, 1.0),
        fingerprint=fingerprint,
        train_sink=int(meta.get("sink", 128)),
        train_local=int(meta.get("local", 256)),
        metadata={"checkpoint": str(directory), **source, **metadata},
        tie_break=None if tie_break is None else tie_break[0],
    )
