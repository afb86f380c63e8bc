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

from rlkv._io import atomic_write_text, read_text_file
from rlkv.errors import UserError
from rlkv.geometry import attention_geometry, text_config

FORMAT_NAME = "rlkv-head-mask"
FORMAT_VERSION = 1

# file names of a mask folder: ours (`save_pretrained`), the RLKV authors' and DuoAttention's
MASK_JSON = "head_mask.json"
MASK_TSV = "head_mask.tsv"
MODEL_CARD = "README.md"
RLKV_AUTHORS_TSV = "adapter_weights.tsv"
DUO_TSV = "full_attention_heads.tsv"
DUO_CONFIG = "config.json"

# what `HeadMask.metadata["tie_break"]` says when the tie-break came from training
TIE_BREAK_BELOW_ZERO = "gates.below_zero: how far the optimizer pushed each gate below 0, summed over steps"


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


@dataclass
class HeadMask:
    """Per-(layer, KV head) importance scores in [0, 1] with the fingerprint of their model.

    scores: FloatTensor[L, H_kv]; higher = needs the full KV cache more.
    tie_break: FloatTensor[L, H_kv] or None; a second key, higher = more important, that ranks
    heads whose scores are equal (gates clamped to exactly 0 all score 0.0). Only where both tie
    does the lower (layer, head) index go first. Training records it (`HeadGates.below_zero`: how
    far the optimizer pushed each gate below 0, summed over steps); `metadata["tie_break"]` says
    where it came from.
    """

    scores: torch.Tensor
    fingerprint: ModelFingerprint
    train_sink: int = 128
    train_local: int = 256
    inference_sink: int = 16
    inference_local: int = 64
    metadata: dict[str, Any] = field(default_factory=dict)
    tie_break: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self.scores = torch.as_tensor(self.scores, dtype=torch.float32).detach().cpu().clone()
        _validate_scores(self.scores, self.fingerprint, source="scores")
        _check_unit_interval(self.scores, source="scores")
        if self.tie_break is not None:
            self.tie_break = torch.as_tensor(self.tie_break, dtype=torch.float32).detach().cpu().clone()
            _validate_scores(self.tie_break, self.fingerprint, source="tie_break")

    # construction -------------------------------------------------------------------------
    @classmethod
    def from_gates(cls, gates: Any, model: Any, **metadata: Any) -> HeadMask:
        """Build from `HeadGates` (or an alpha tensor [L, H_kv]); scores are the gates clamped to [0, 1].

        The tie-break is the gates' `below_zero` (see `HeadGates`) when they carry one.
        """
        alpha = getattr(gates, "alpha", gates)
        scores = torch.as_tensor(alpha).detach().float().clamp(0.0, 1.0)
        below_zero = getattr(gates, "below_zero", None)
        if below_zero is not None:
            metadata = {"tie_break": TIE_BREAK_BELOW_ZERO, **metadata}
        return cls(
            scores=scores,
            fingerprint=ModelFingerprint.of(model),
            train_sink=int(getattr(gates, "sink", 128)),
            train_local=int(getattr(gates, "local", 256)),
            metadata=dict(metadata),
            tie_break=below_zero,
        )

    @classmethod
    def from_tsv(cls, path: str | os.PathLike, model: Any, **metadata: Any) -> HeadMask:
        """Read a DuoAttention / RLKV official TSV (L rows x H_kv tab-separated floats, no header)."""
        path = Path(path)
        rows = []
        text = read_text_file(path, what="head-mask TSV", error=HeadMaskError)
        for lineno, line in enumerate(text.splitlines(), start=1):
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

    @classmethod
    def from_pretrained(
        cls,
        source: str | os.PathLike,
        model: Any = None,
        *,
        revision: str | None = None,
        subfolder: str | None = None,
        **hub_kwargs: Any,
    ) -> HeadMask:
        """Read a head mask from a file, a folder or a Hugging Face Hub repo, checked against `model`.

        `source` is any of: a folder written by `save_pretrained` (or a `train_gates.py` checkpoint),
        a `head_mask.json`, an RLKV-authors folder or file (`adapter_weights.tsv`), a DuoAttention
        folder (`full_attention_heads.tsv` + `config.json`, whose `sink_size` / `recent_size` become
        `train_sink` / `train_local`), any L x H_kv TSV, or a Hub repo id holding one of these
        (`revision`, `subfolder`; `hub_kwargs` go to `huggingface_hub.snapshot_download`, e.g.
        `cache_dir`, `local_files_only`, `token`). `model` is a model (a meta-device one is enough)
        or its `PretrainedConfig`: required for a TSV, which carries no fingerprint, and when given
        the mask is checked against it (`HeadMaskError` naming each mismatch).
        """
        path = Path(source).expanduser()
        if not path.exists() and _looks_like_hub_id(str(source)):
            path = _snapshot(str(source), revision, subfolder, hub_kwargs)
        elif subfolder:
            path = path / subfolder
        if not path.exists():
            raise HeadMaskError(
                f"{path}: no such head-mask file or folder (give a folder written by HeadMask.save_pretrained, "
                f"a head_mask.json, an {RLKV_AUTHORS_TSV} / {DUO_TSV} file or folder, or a Hub repo id)"
            )
        if path.is_dir():
            path = _mask_file_in(path)
        if path.suffix != ".tsv":
            mask = cls.load(path)
            if model is not None:
                mask.check_compatible(model)
            return mask
        if model is None:
            raise HeadMaskError(
                f"{path}: a TSV head mask holds scores only; pass the model (or its config, or a meta-device "
                "model) so its geometry can be checked and recorded"
            )
        fields: dict[str, Any] = {"format": "tsv"}
        if path.name == RLKV_AUTHORS_TSV:
            fields["format"] = "rlkv-authors"
        elif path.name == DUO_TSV and (path.parent / DUO_CONFIG).exists():
            fields = {**_duo_config(path.parent / DUO_CONFIG), "format": "duo-attention"}
        mask = cls.from_tsv(path, model)
        mask.train_sink = int(fields.pop("sink_size", mask.train_sink))
        mask.train_local = int(fields.pop("recent_size", mask.train_local))
        mask.metadata.update(fields)
        return mask

    def save_pretrained(self, directory: str | os.PathLike) -> Path:
        """Write a mask folder: `head_mask.json`, `head_mask.tsv` and a short model card (all atomic)."""
        directory = Path(directory)
        self.save(directory / MASK_JSON)
        self.to_tsv(directory / MASK_TSV)
        atomic_write_text(directory / MODEL_CARD, self._model_card())
        return directory

    def push_to_hub(
        self,
        repo_id: str,
        *,
        private: bool | None = None,
        token: str | None = None,
        revision: str | None = None,
        commit_message: str = "Upload rlkv head mask",
    ) -> Any:
        """Upload the `save_pretrained` folder to a Hub model repo (created if missing); returns the commit info."""
        import tempfile

        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            return api.upload_folder(
                folder_path=tmp, repo_id=repo_id, revision=revision, commit_message=commit_message
            )

    def _model_card(self) -> str:
        fp = self.fingerprint
        # the Hub id of the base model: recorded explicitly (a mask of a local copy), else the
        # fingerprint's name when it is one (not when it names a folder on this machine)
        named = (
            fp.name_or_path
            if _looks_like_hub_id(fp.name_or_path) and not Path(fp.name_or_path).exists()
            else ""
        )
        base = str(self.metadata.get("base_model") or named)
        header = ["---", "library_name: rlkv", "tags:", "- rlkv", "- kv-cache", "- head-mask"]
        header += [f"base_model: {base}"] if base else []
        header += ["---", ""]
        counts = ", ".join(f"s={s}: {self.num_full_heads(s)} full" for s in (0.25, 0.5, 0.75, 0.875))
        body = f"""# rlkv head mask for {fp.name_or_path or fp.model_type}

One score per (layer, KV head) in [0, 1]: how much that head needs a full KV cache, {self._provenance()}.

- geometry: {fp.model_type}, {fp.num_hidden_layers} layers x {fp.num_key_value_heads} KV heads, head_dim {fp.head_dim}
- trained with sink {self.train_sink} / local {self.train_local}; inference sink {self.inference_sink} / local {self.inference_local}
- full KV heads by sparsity: {counts}
- {self._ranking_line()}

```python
from rlkv import HeadMask
from rlkv.inference import CompressionConfig

mask = HeadMask.from_pretrained("<this repo or folder>", model)  # model or its config: geometry check
config = CompressionConfig(head_mask=mask, sparsity=0.5)
```

Files: `{MASK_JSON}` (scores, model fingerprint, sink/local, metadata), `{MASK_TSV}` (scores only,
L rows x H_kv columns, the RLKV / DuoAttention layout).
"""
        return "\n".join(header) + body

    def _provenance(self) -> str:
        """How the scores were made, for the card."""
        if self.metadata.get("method") == "ablation":
            return (
                "scored by `rlkv ablation-mask` (the teacher-forced NLL increase when that head alone "
                "runs sink + local attention, min-max scaled; raw increases in the metadata's `delta_nll`)"
            )
        return "learned by RLKV gates (or imported)"

    def _ranking_line(self) -> str:
        """The card's line on how heads with equal scores are ranked."""
        counts = torch.unique(self.scores, return_counts=True)[1]
        tied = int(counts[counts > 1].sum())
        if self.tie_break is None:
            return (
                f"ranking: by score; {tied} heads share a score with another, ranked by (layer, head) index"
            )
        source = self.metadata.get("tie_break", "tie_break")
        return (
            f"ranking: by score; the {tied} heads that share a score with another by `tie_break` ({source}); "
            f"pairs decided by index alone: {self.index_decided_ties()}"
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
            **({} if self.tie_break is None else {"tie_break": self.tie_break.tolist()}),
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
        text = read_text_file(path, what="head-mask file", error=HeadMaskError)
        try:
            doc = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
            raise HeadMaskError(
                f"{path}: not valid JSON ({type(e).__name__}: {e}); expected a file written by HeadMask.save"
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
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) for r in raw for x in r):
            raise HeadMaskError(
                f"{source}: field 'scores' holds a non-number (true/false, a string, null...)"
            )
        try:
            scores = torch.tensor(raw, dtype=torch.float32)
        except (TypeError, ValueError, OverflowError) as e:
            raise HeadMaskError(
                f"{source}: field 'scores' holds a value that is not a float32 ({e})"
            ) from None
        _validate_scores(scores, fp, source=f"{source}: field 'scores'")
        _check_unit_interval(scores, source=f"{source}: field 'scores'")
        tie_break = _tie_break_field(doc.get("tie_break"), fp, source)
        metadata = doc.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise HeadMaskError(
                f"{source}: field 'metadata' must be a JSON object, not {type(metadata).__name__}"
            )
        defaults = {"train_sink": 128, "train_local": 256, "inference_sink": 16, "inference_local": 64}
        sizes = {
            name: _token_count(doc.get(name, default), f"{source}: field {name!r}")
            for name, default in defaults.items()
        }
        return cls(scores=scores, fingerprint=fp, metadata=dict(metadata), tie_break=tie_break, **sizes)

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

        Heads are ranked by score, equal scores by `tie_break` (when the mask has one), and only then
        towards the lower (layer, head) index, so the result is deterministic. `min_full_per_layer` first reserves that many top heads in every layer, then
        fills the remaining slots globally (the total stays round((1 - s) * L * H) unless the
        reservation alone exceeds it).
        """
        if not 0 <= min_full_per_layer <= self.num_kv_heads:
            raise HeadMaskError(
                f"min_full_per_layer={min_full_per_layer} must be in [0, {self.num_kv_heads}]"
            )
        k = self.num_full_heads(sparsity)
        flat = self.scores.flatten()
        order = self.order().flip(0)
        order = order[:, 0] * self.num_kv_heads + order[:, 1]  # most important first
        mask = torch.zeros_like(flat, dtype=torch.bool)
        if min_full_per_layer:
            rank = torch.empty_like(order)
            rank[order] = torch.arange(order.numel())
            per_layer = torch.sort(rank.view_as(self.scores), dim=1).indices[:, :min_full_per_layer]
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
        """LongTensor[L * H_kv, 2]: (layer, head) pairs from least to most important (compression order).

        By score, then `tie_break`; where both tie, the higher (layer, head) index counts as less
        important (so the lower index keeps its full cache first).
        """
        idx = rank_heads(self.scores, self.tie_break).flip(0)
        return torch.stack([idx // self.num_kv_heads, idx % self.num_kv_heads], dim=1)

    def index_decided_ties(self) -> int:
        """How many neighbouring pairs of the ranking are decided by index alone (equal score and tie-break)."""
        order = self.order()
        flat = order[:, 0] * self.num_kv_heads + order[:, 1]
        keys = [self.scores.flatten()[flat]]
        if self.tie_break is not None:
            keys.append(self.tie_break.flatten()[flat])
        same = torch.ones(flat.numel() - 1, dtype=torch.bool)
        for key in keys:
            same &= key[1:] == key[:-1]
        return int(same.sum())

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


def _looks_like_hub_id(text: str) -> bool:
    """`owner/name`: two non-empty parts without path syntax (what a Hub repo id looks like)."""
    parts = text.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not text.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for c in text.replace("/", ""))
    )


def _snapshot(repo_id: str, revision: str | None, subfolder: str | None, hub_kwargs: dict[str, Any]) -> Path:
    """Download (or find in the local Hub cache) the mask files of `repo_id`; the folder holding them."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError, RepositoryNotFoundError

    prefix = f"{subfolder.strip('/')}/" if subfolder else ""
    patterns = [prefix + name for name in (MASK_JSON, MASK_TSV, RLKV_AUTHORS_TSV, DUO_TSV, DUO_CONFIG)]
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns, **hub_kwargs)
    except (LocalEntryNotFoundError, RepositoryNotFoundError, HFValidationError, OSError) as e:
        raise HeadMaskError(
            f"{repo_id}: not a local path, and no head mask could be fetched from the Hugging Face Hub "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    return Path(folder) / prefix


def _mask_file_in(folder: Path) -> Path:
    """The mask file a folder holds, in order of preference: ours, the RLKV authors', DuoAttention's."""
    for name in (MASK_JSON, RLKV_AUTHORS_TSV):
        if (folder / name).is_file():
            return folder / name
    if (folder / DUO_TSV).is_file():
        if not (folder / DUO_CONFIG).is_file():
            raise HeadMaskError(
                f"{folder}: a DuoAttention folder needs {DUO_CONFIG} (sink_size, recent_size) next to {DUO_TSV}; "
                f"give the {DUO_TSV} file itself to read the scores alone"
            )
        return folder / DUO_TSV
    raise HeadMaskError(
        f"{folder}: holds no head mask: expected {MASK_JSON}, {RLKV_AUTHORS_TSV} or {DUO_TSV} (+ {DUO_CONFIG})"
    )


def _duo_config(path: Path) -> dict[str, Any]:
    """DuoAttention's training config.json: sink_size and recent_size (ints) plus its other settings."""
    try:
        doc = json.loads(read_text_file(path, what="DuoAttention config.json", error=HeadMaskError))
    except (ValueError, RecursionError) as e:
        raise HeadMaskError(f"{path}: not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(doc, dict):
        raise HeadMaskError(f"{path}: expected a JSON object with sink_size and recent_size")
    for name in ("sink_size", "recent_size"):
        value = doc.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise HeadMaskError(
                f"{path}: field {name!r} must be an integer >= 0 (DuoAttention's training {name}), got {value!r}"
            )
    return doc


def _check_sparsity(sparsity: float) -> None:
    if not isinstance(sparsity, (int, float)) or math.isnan(sparsity) or not 0.0 <= sparsity <= 1.0:
        raise HeadMaskError(
            f"sparsity={sparsity!r} must be a number in [0, 1] (fraction of KV heads compressed)"
        )


def _check_unit_interval(scores: torch.Tensor, source: str) -> None:
    if scores.numel() and (scores.min() < 0 or scores.max() > 1):
        bad = ((scores < 0) | (scores > 1)).nonzero()[0].tolist()
        raise HeadMaskError(
            f"{source}: score {scores[bad[0], bad[1]].item():.4g} at layer {bad[0]}, head {bad[1]} is outside "
            "[0, 1]; scores are clamped gate values (HeadMask.from_tsv clamps a TSV's values for you)"
        )


def rank_heads(scores: torch.Tensor, tie_break: torch.Tensor | None = None) -> torch.Tensor:
    """Flat (layer * H_kv + head) indices of `scores` [L, H_kv], most important first.

    By score (higher first), equal scores by `tie_break` (same shape, higher first), and where both
    tie the lower index first. Works on any device; no host read.
    """
    # stable sorts from the last key to the first; the index is the last key
    idx = torch.arange(scores.numel(), device=scores.device)
    if tie_break is not None:
        idx = idx[torch.sort(-tie_break.flatten()[idx], stable=True).indices]
    return idx[torch.sort(-scores.flatten()[idx], stable=True).indices]


def _tie_break_field(raw: Any, fp: ModelFingerprint, source: str) -> torch.Tensor | None:
    """The optional 'tie_break' field of a mask document: None or FloatTensor[L, H_kv]."""
    if raw is None:
        return None
    where = f"{source}: field 'tie_break'"
    if (
        not isinstance(raw, list)
        or not all(isinstance(r, list) for r in raw)
        or len({len(r) for r in raw}) > 1
    ):
        raise HeadMaskError(f"{where} must be a list of L lists of H_kv numbers (or absent)")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for r in raw for x in r):
        raise HeadMaskError(f"{where} holds a non-number; write floats, or drop the field")
    try:
        tie_break = torch.tensor(raw, dtype=torch.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise HeadMaskError(f"{where} holds a value that is not a float32 ({e})") from None
    _validate_scores(tie_break, fp, source=where)
    return tie_break


MAX_TOKENS = 1 << 30  # a sink/local size beyond any context length


def _token_count(value: Any, where: str) -> int:
    """A sink/local size: an integer from 0 to MAX_TOKENS (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise HeadMaskError(f"{where}={value!r} must be an integer number of tokens from 0 to {MAX_TOKENS}")
    return value


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
