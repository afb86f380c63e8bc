"""The file formats of a head mask: rlkv's JSON document, the L x H_kv TSV (RLKV authors', DuoAttention's),
DuoAttention's config.json, and which file of a mask folder holds the mask."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from rlkv._io import read_text_file
from rlkv.head_mask.fingerprint import HeadMaskError, ModelFingerprint, check_unit_interval, validate_scores

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

MAX_TOKENS = 1 << 30  # a sink/local size beyond any context length
SIZE_DEFAULTS = {"train_sink": 128, "train_local": 256, "inference_sink": 16, "inference_local": 64}


def read_tsv_scores(path: Path) -> torch.Tensor:
    """FloatTensor[L, H_kv] of a TSV: L rows of H_kv tab-separated floats, no header (not yet checked
    against a model)."""
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
    return torch.tensor(rows, dtype=torch.float32)


def tsv_text(scores: torch.Tensor) -> str:
    """The TSV of `scores` [L, H_kv] (floats written exactly)."""
    return "\n".join("\t".join(repr(float(x)) for x in row) for row in scores.tolist()) + "\n"


def mask_file_in(folder: Path) -> Path:
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


def check_folder_tsv(folder: Path, scores: torch.Tensor) -> None:
    """Refuse a mask folder whose head_mask.tsv disagrees with its head_mask.json `scores` [L, H_kv]
    (one file edited or replaced by hand: which one a tool reads would change the mask silently)."""
    path = folder / MASK_TSV
    if not path.is_file():
        return
    tsv = read_tsv_scores(path)
    same = tsv.shape == scores.shape and torch.allclose(tsv, scores.float().cpu(), rtol=1e-5, atol=1e-6)
    if not same:
        where = f"shape {tuple(tsv.shape)} vs {tuple(scores.shape)}"
        if tsv.shape == scores.shape:
            layer, head = divmod(int((tsv - scores.float().cpu()).abs().argmax()), tsv.shape[1])
            where = f"layer {layer} KV head {head}: {tsv[layer, head]:.6g} vs {scores[layer, head]:.6g}"
        raise HeadMaskError(
            f"{folder}: {MASK_TSV} disagrees with {MASK_JSON} ({where}): write the folder again with "
            f"HeadMask.save_pretrained / rlkv export-mask, or delete the stale file"
        )


def tsv_fields(path: Path) -> dict[str, Any]:
    """What a TSV's name and neighbours say of it: `format` (tsv, rlkv-authors, duo-attention) and, for
    DuoAttention, its config's settings (`sink_size`, `recent_size`, ...)."""
    if path.name == RLKV_AUTHORS_TSV:
        return {"format": "rlkv-authors"}
    if path.name == DUO_TSV and (path.parent / DUO_CONFIG).exists():
        return {**duo_config(path.parent / DUO_CONFIG), "format": "duo-attention"}
    return {"format": "tsv"}


def duo_config(path: Path) -> dict[str, Any]:
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


def read_document(path: Path) -> Any:
    """The parsed JSON of a mask file (`HeadMaskError` when it is not JSON)."""
    text = read_text_file(path, what="head-mask file", error=HeadMaskError)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser goes
        raise HeadMaskError(
            f"{path}: not valid JSON ({type(e).__name__}: {e}); expected a file written by HeadMask.save"
        ) from None


def document_fields(doc: Any, source: str) -> dict[str, Any]:
    """Validate a mask's JSON document; the `HeadMask` fields it holds (scores, fingerprint, sizes,
    metadata, tie_break)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise HeadMaskError(f"{source}: field 'format' must be {FORMAT_NAME!r}; is this a head-mask file?")
    version = doc.get("format_version")
    if version != FORMAT_VERSION:
        raise HeadMaskError(
            f"{source}: unknown format_version {version!r}; this rlkv reads version {FORMAT_VERSION}"
        )
    fp = _fingerprint_field(doc.get("model"), source)
    raw = doc.get("scores")
    if not isinstance(raw, list) or not raw or not all(isinstance(r, list) for r in raw):
        raise HeadMaskError(f"{source}: field 'scores' must be a list of L lists of H_kv numbers")
    if len({len(r) for r in raw}) != 1:
        raise HeadMaskError(f"{source}: field 'scores' rows have different lengths")
    if any(isinstance(x, bool) or not isinstance(x, (int, float)) for r in raw for x in r):
        raise HeadMaskError(f"{source}: field 'scores' holds a non-number (true/false, a string, null...)")
    try:
        scores = torch.tensor(raw, dtype=torch.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise HeadMaskError(f"{source}: field 'scores' holds a value that is not a float32 ({e})") from None
    validate_scores(scores, fp, source=f"{source}: field 'scores'")
    check_unit_interval(scores, source=f"{source}: field 'scores'")
    tie_break = _tie_break_field(doc.get("tie_break"), fp, source)
    metadata = doc.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise HeadMaskError(
            f"{source}: field 'metadata' must be a JSON object, not {type(metadata).__name__}"
        )
    sizes = {
        name: _token_count(doc.get(name, default), f"{source}: field {name!r}")
        for name, default in SIZE_DEFAULTS.items()
    }
    return dict(scores=scores, fingerprint=fp, metadata=dict(metadata), tie_break=tie_break, **sizes)


def _fingerprint_field(model: Any, source: str) -> ModelFingerprint:
    keys = ("name_or_path", "model_type", "num_hidden_layers", "num_key_value_heads", "head_dim")
    if not isinstance(model, dict) or any(k not in model for k in keys):
        raise HeadMaskError(f"{source}: field 'model' must hold {', '.join(keys)}")
    try:
        return ModelFingerprint(
            name_or_path=str(model["name_or_path"]),
            model_type=str(model["model_type"]),
            num_hidden_layers=int(model["num_hidden_layers"]),
            num_key_value_heads=int(model["num_key_value_heads"]),
            head_dim=int(model["head_dim"]),
        )
    except (TypeError, ValueError) as e:
        raise HeadMaskError(f"{source}: field 'model' has a non-integer size ({e})") from None


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
    validate_scores(tie_break, fp, source=where)
    return tie_break


def _token_count(value: Any, where: str) -> int:
    """A sink/local size: an integer from 0 to MAX_TOKENS (not a bool, a float or a string)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKENS:
        raise HeadMaskError(f"{where}={value!r} must be an integer number of tokens from 0 to {MAX_TOKENS}")
    return value
