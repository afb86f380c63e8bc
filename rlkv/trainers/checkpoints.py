"""Gate checkpoint files: write them, read them, rebuild the head mask from them.

A gate checkpoint directory holds `gates.safetensors` (tensor `alpha` [L, H_kv] plus sink/local
and the model's name in the metadata), the model's `config.json`, and `head_mask.json` /
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

from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint

GATES_FILE = "gates.safetensors"
HEAD_MASK_JSON = "head_mask.json"
HEAD_MASK_TSV = "head_mask.tsv"
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
) -> HeadMask:
    """Write gates.safetensors, config.json, head_mask.json and head_mask.tsv into `directory` (atomically).

    Returns the exported `HeadMask` (scores = alpha clamped to [0, 1]).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    alpha = alpha.detach().float().cpu().contiguous()
    name = str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", ""))
    tmp = directory / f".{GATES_FILE}.tmp"
    save_file(
        {"alpha": alpha},
        str(tmp),
        metadata={"format": "rlkv-gates", "sink": str(sink), "local": str(local), "model_name_or_path": name},
    )
    os.replace(tmp, directory / GATES_FILE)
    config.save_pretrained(directory)
    mask = HeadMask.from_gates(
        SimpleNamespace(alpha=alpha, sink=sink, local=local), config, **(metadata or {})
    )
    mask.save(directory / HEAD_MASK_JSON)
    mask.to_tsv(directory / HEAD_MASK_TSV)
    return mask


def load_gate_checkpoint(directory: str | os.PathLike) -> tuple[torch.Tensor, dict[str, str]]:
    """Read `gates.safetensors` from a checkpoint directory: (alpha FloatTensor[L, H_kv], metadata)."""
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
    return tensors["alpha"], metadata


def head_mask_from_checkpoint(directory: str | os.PathLike, **metadata: Any) -> HeadMask:
    """Rebuild the `HeadMask` of a gate checkpoint from its gates.safetensors and config.json."""
    alpha, meta = load_gate_checkpoint(directory)
    config = AutoConfig.from_pretrained(directory)
    fingerprint = ModelFingerprint.of(config)
    if meta.get("model_name_or_path"):
        fingerprint = dataclasses.replace(fingerprint, name_or_path=meta["model_name_or_path"])
    return HeadMask(
        scores=alpha.clamp(0.0, 1.0),
        fingerprint=fingerprint,
        train_sink=int(meta.get("sink", 128)),
        train_local=int(meta.get("local", 256)),
        metadata={"checkpoint": str(directory), **metadata},
    )
