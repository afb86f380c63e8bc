"""The model a head mask is tied to (`ModelFingerprint`), `HeadMaskError`, and the checks of a score
tensor against a fingerprint (shape, finiteness, range)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from rlkv.errors import UserError
from rlkv.geometry import attention_geometry, text_config


class HeadMaskError(ValueError, UserError):
    """A head mask that is malformed or does not belong to the model it is used with."""


@dataclass(frozen=True)
class ModelFingerprint:
    """The attention geometry a head mask is tied to."""

    name_or_path: str
    model_type: str
    num_hidden_layers: int
    num_key_value_heads: int
    head_dim: int

    @classmethod
    def of(cls, model_or_config: Any) -> ModelFingerprint:
        """Fingerprint of a transformers model or config (or a PEFT-wrapped model: the base model's)."""
        config = text_config(model_or_config)
        geometry = attention_geometry(config)
        return cls(
            name_or_path=str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")),
            model_type=str(config.model_type),
            num_hidden_layers=geometry.num_hidden_layers,
            num_key_value_heads=geometry.num_key_value_heads,
            head_dim=geometry.head_dim,
        )

    def mismatches(self, other: ModelFingerprint) -> list[str]:
        """Fields whose values differ and make the mask unusable (name is advisory only)."""
        out = []
        for name in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: mask has {getattr(self, name)}, model has {getattr(other, name)}")
        return out


def validate_scores(scores: torch.Tensor, fp: ModelFingerprint, source: str) -> None:
    """`HeadMaskError` unless `scores` is a finite [L, H_kv] tensor of `fp`'s geometry."""
    expected = (fp.num_hidden_layers, fp.num_key_value_heads)
    if scores.dim() != 2 or tuple(scores.shape) != expected:
        raise HeadMaskError(
            f"{source}: shape {tuple(scores.shape)} does not match the model's "
            f"(num_hidden_layers, num_key_value_heads) = {expected}"
        )
    if not torch.isfinite(scores).all():
        bad = (~torch.isfinite(scores)).nonzero()[0].tolist()
        raise HeadMaskError(f"{source}: non-finite score (NaN or inf) at layer {bad[0]}, head {bad[1]}")


def check_unit_interval(scores: torch.Tensor, source: str) -> None:
    """`HeadMaskError` naming the first score outside [0, 1]."""
    if scores.numel() and (scores.min() < 0 or scores.max() > 1):
        bad = ((scores < 0) | (scores > 1)).nonzero()[0].tolist()
        raise HeadMaskError(
            f"{source}: score {scores[bad[0], bad[1]].item():.4g} at layer {bad[0]}, head {bad[1]} is outside "
            "[0, 1]; scores are clamped gate values (HeadMask.from_tsv clamps a TSV's values for you)"
        )


def check_sparsity(sparsity: float) -> None:
    """`HeadMaskError` unless `sparsity` is a number in [0, 1] (not a bool): the one rule for a sparsity,
    which `CompressionConfig` applies too."""
    bad_type = isinstance(sparsity, bool) or not isinstance(sparsity, (int, float))
    if bad_type or math.isnan(sparsity) or not 0.0 <= sparsity <= 1.0:
        raise HeadMaskError(
            f"sparsity={sparsity!r}: must be a number in [0, 1] (fraction of KV heads compressed)"
        )
