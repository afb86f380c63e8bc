"""The head-mask artifact: what the gates learned, tied to the model it came from.

A `HeadMask` stores one score per (layer, KV head) - the clamped gate value `alpha` - plus a
fingerprint of the model (name, type, layers, KV heads, head dim). `full_heads(s)` turns the
scores into the boolean layout of a head-mixed cache at target sparsity `s`: the top
`round((1 - s) * L * H)` heads keep a full KV cache, the rest are compressed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlkv._io import atomic_write_text

FORMAT_NAME = "rlkv-head-mask"
FORMAT_VERSION = 1


class HeadMaskError(ValueError):
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
        config = getattr(model_or_config, "config", model_or_config)
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            name_or_path=str(getattr(config, "name_or_path", "") or getattr(config, "_name_or_path", "")),
            model_type=str(config.model_type),
            num_hidden_layers=int(config.num_hidden_layers),
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
        )

    def mismatches(self, other: ModelFingerprint) -> list[str]:
        """Fields whose values differ and make the mask unusable (name is advisory only)."""
        out = []
        for name in ("num_hidden_layers", "num_key_value_heads", "head_dim"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: mask has {getattr(self, name)}, model has {getattr(other, name)}")
        return out


@dataclass
class HeadMask:
    """Per-(layer, KV head) importance scores in [0, 1] with the fingerprint of their model.

    scores: FloatTensor[L, H_kv]; higher = needs the full KV cache more.
    """

    scores: torch.Tensor
    fingerprint: ModelFingerprint
    train_sink: int = 128
    train_local: int = 256
    inference_sink: int = 16
    inference_local: int = 64
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.scores = torch.as_tensor(self.scores, dtype=torch.float32).detach().cpu().clone()
        _validate_scores(self.scores, self.fingerprint, source="scores")

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_gates(cls, gates: Any, model: Any, **metadata: Any) -> HeadMask:
        """Build from `HeadGates` (or an alpha tensor [L, H_kv]); scores are the gates clamped to [0, 1]."""
        alpha = getattr(gates, "alpha", gates)
        scores = torch.as_tensor(alpha).detach().float().clamp(0.0, 1.0)
        return cls(
            scores=scores,
            fingerprint=ModelFingerprint.of(model),
            train_sink=int(getattr(gates, "sink", 128)),
            train_local=int(getattr(gates, "local", 256)),
            metadata=dict(metadata),
        )

    @classmethod
    def from_tsv(cls, path: str | os.PathLike, model: Any, **metadata: Any) -> HeadMask:
        """Read a DuoAttention / RLKV official TSV (L rows x H_kv tab-separated floats, no header)."""
        path = Path(path)
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append([float(x) for x in line.strip().split("\t")])
            except ValueError as e:
                raise HeadMaskError(f"{path}: line {lineno} is not tab-separated floats ({e})") from None
        if not rows or len({len(r) for r in rows}) != 1:
            raise HeadMaskError(f"{path}: expected L rows of H_kv tab-separated floats with equal length")
        fp = ModelFingerprint.of(model)
        scores = torch.tensor(rows, dtype=torch.float32)
        _validate_scores(scores, fp, source=str(path))
        return cls(
            scores=scores.clamp(0.0, 1.0), fingerprint=fp, metadata={"source_tsv": str(path), **metadata}
        )

    # persistence --------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON document (format name and version first)."""
        return {
            "format": FORMAT_NAME,
            "format_version": FORMAT_VERSION,
            "model": self.fingerprint.__dict__.copy(),
            "scores": [[float(x) for x in row] for row in self.scores.tolist()],
            "train_sink": self.train_sink,
            "train_local": self.train_local,
            "inference_sink": self.inference_sink,
            "inference_local": self.inference_local,
            "metadata": self.metadata,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write JSON atomically (temp file + rename)."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1, default=str) + "\n")

    def to_tsv(self, path: str | os.PathLike) -> Path:
        """Write the official TSV format (scores only) atomically."""
        text = "\n".join("\t".join(repr(float(x)) for x in row) for row in self.scores.tolist()) + "\n"
        return atomic_write_text(path, text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadMask:
        """Read and validate a JSON head mask written by `save`."""
        path = Path(path)
        try:
            doc = json.loads(path.read_text())
        except FileNotFoundError:
            raise HeadMaskError(f"{path}: no such head-mask file") from None
        except json.JSONDecodeError as e:
            raise HeadMaskError(
                f"{path}: not valid JSON ({e}); expected a file written by HeadMask.save"
            ) from None
        return cls.from_dict(doc, source=str(path))

    @classmethod
    def from_dict(cls, doc: Any, source: str = "<dict>") -> HeadMask:
        """Validate and build from the JSON document."""
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise HeadMaskError(
                f"{source}: field 'format' must be {FORMAT_NAME!r}; is this a head-mask file?"
            )
        version = doc.get("format_version")
        if version != FORMAT_VERSION:
            raise HeadMaskError(
                f"{source}: unknown format_version {version!r}; this rlkv reads version {FORMAT_VERSION}"
            )
        model = doc.get("model")
        keys = ("name_or_path", "model_type", "num_hidden_layers", "num_key_value_heads", "head_dim")
        if not isinstance(model, dict) or any(k not in model for k in keys):
            raise HeadMaskError(f"{source}: field 'model' must hold {', '.join(keys)}")
        try:
            fp = ModelFingerprint(
                name_or_path=str(model["name_or_path"]),
                model_type=str(model["model_type"]),
                num_hidden_layers=int(model["num_hidden_layers"]),
                num_key_value_heads=int(model["num_key_value_heads"]),
                head_dim=int(model["head_dim"]),
            )
        except (TypeError, ValueError) as e:
            raise HeadMaskError(f"{source}: field 'model' has a non-integer size ({e})") from None
        raw = doc.get("scores")
        if not isinstance(raw, list) or not raw or not all(isinstance(r, list) for r in raw):
            raise HeadMaskError(f"{source}: field 'scores' must be a list of L lists of H_kv numbers")
        if len({len(r) for r in raw}) != 1:
            raise HeadMaskError(f"{source}: field 'scores' rows have different lengths")
        try:
            scores = torch.tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError) as e:
            raise HeadMaskError(f"{source}: field 'scores' holds a non-number ({e})") from None
        _validate_scores(scores, fp, source=f"{source}: field 'scores'")
        try:
            return cls(
                scores=scores,
                fingerprint=fp,
                train_sink=int(doc.get("train_sink", 128)),
                train_local=int(doc.get("train_local", 256)),
                inference_sink=int(doc.get("inference_sink", 16)),
                inference_local=int(doc.get("inference_local", 64)),
                metadata=dict(doc.get("metadata") or {}),
            )
        except (TypeError, ValueError) as e:
            raise HeadMaskError(f"{source}: sink/local fields must be integers ({e})") from None

    # use ----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.scores.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.scores.shape[1]

    def num_full_heads(self, sparsity: float) -> int:
        """How many KV heads keep a full cache at `sparsity`: round((1 - s) * L * H)."""
        _check_sparsity(sparsity)
        return int(round((1.0 - sparsity) * self.scores.numel()))

    def full_heads(self, sparsity: float, min_full_per_layer: int = 0) -> torch.Tensor:
        """BoolTensor[L, H_kv]: True where the head keeps a full KV cache at target `sparsity`.

        Heads are ranked by score; ties break towards the lower (layer, head) index so the result is
        deterministic. `min_full_per_layer` first reserves that many top heads in every layer, then
        fills the remaining slots globally (the total stays round((1 - s) * L * H) unless the
        reservation alone exceeds it).
        """
        if not 0 <= min_full_per_layer <= self.num_kv_heads:
            raise HeadMaskError(
                f"min_full_per_layer={min_full_per_layer} must be in [0, {self.num_kv_heads}]"
            )
        k = self.num_full_heads(sparsity)
        flat = self.scores.flatten()
        # stable sort on -score keeps the lower index first among ties
        order = torch.sort(-flat, stable=True).indices
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if min_full_per_layer:
            per_layer = torch.sort(-self.scores, dim=1, stable=True).indices[:, :min_full_per_layer]
            rows = torch.arange(self.num_layers).unsqueeze(1) * self.num_kv_heads
            mask[(rows + per_layer).flatten()] = True
        remaining = k - int(mask.sum())
        for idx in order.tolist():
            if remaining <= 0:
                break
            if not mask[idx]:
                mask[idx] = True
                remaining -= 1
        return mask.view_as(self.scores)

    def order(self) -> torch.Tensor:
        """LongTensor[L * H_kv, 2]: (layer, head) pairs from least to most important (compression order)."""
        flat = self.scores.flatten()
        idx = torch.sort(flat, stable=True).indices
        return torch.stack([idx // self.num_kv_heads, idx % self.num_kv_heads], dim=1)

    def check_compatible(self, model_or_config: Any) -> None:
        """Raise `HeadMaskError` naming every mismatch if this mask was not made for `model_or_config`."""
        problems = self.fingerprint.mismatches(ModelFingerprint.of(model_or_config))
        if problems:
            raise HeadMaskError(
                f"head mask was made for {self.fingerprint.name_or_path or 'another model'} and does not fit this "
                f"model ({'; '.join(problems)}); train or export a mask for this model"
            )

    @staticmethod
    def random(model: Any, seed: int = 0) -> HeadMask:
        """Uniform random scores (the `random-mask` baseline), seeded."""
        fp = ModelFingerprint.of(model)
        g = torch.Generator().manual_seed(seed)
        scores = torch.rand(fp.num_hidden_layers, fp.num_key_value_heads, generator=g)
        return HeadMask(scores=scores, fingerprint=fp, metadata={"kind": "random", "seed": seed})


def _check_sparsity(sparsity: float) -> None:
    if not isinstance(sparsity, (int, float)) or math.isnan(sparsity) or not 0.0 <= sparsity <= 1.0:
        raise HeadMaskError(
            f"sparsity={sparsity!r} must be a number in [0, 1] (fraction of KV heads compressed)"
        )


def _validate_scores(scores: torch.Tensor, fp: ModelFingerprint, source: str) -> None:
    expected = (fp.num_hidden_layers, fp.num_key_value_heads)
    if scores.dim() != 2 or tuple(scores.shape) != expected:
        raise HeadMaskError(
            f"{source}: shape {tuple(scores.shape)} does not match the model's "
            f"(num_hidden_layers, num_key_value_heads) = {expected}"
        )
    if not torch.isfinite(scores).all():
        bad = (~torch.isfinite(scores)).nonzero()[0].tolist()
        raise HeadMaskError(f"{source}: non-finite score (NaN or inf) at layer {bad[0]}, head {bad[1]}")
