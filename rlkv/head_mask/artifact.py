"""`HeadMask`: what the gates learned, tied to the model it came from (the artifact itself).

Its file formats live in `rlkv.head_mask.formats`, the Hub in `rlkv.head_mask.hub`, the ranking of
heads in `rlkv.ranking`; this class puts them behind one set of fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlkv._io import atomic_write_text
from rlkv.head_mask.fingerprint import (
    HeadMaskError,
    ModelFingerprint,
    check_sparsity,
    check_unit_interval,
    validate_scores,
)
from rlkv.head_mask.formats import (
    DUO_TSV,
    FORMAT_NAME,
    FORMAT_VERSION,
    MASK_JSON,
    MASK_TSV,
    MODEL_CARD,
    RLKV_AUTHORS_TSV,
    TIE_BREAK_BELOW_ZERO,
    check_folder_tsv,
    document_fields,
    mask_file_in,
    read_document,
    read_tsv_scores,
    tsv_fields,
    tsv_text,
)
from rlkv.head_mask.hub import looks_like_hub_id, model_card, snapshot, upload_folder
from rlkv.ranking import compression_order, select_balanced_heads, select_full_heads, ties_decided_by_index


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
        validate_scores(self.scores, self.fingerprint, source="scores")
        check_unit_interval(self.scores, source="scores")
        if self.tie_break is not None:
            self.tie_break = torch.as_tensor(self.tie_break, dtype=torch.float32).detach().cpu().clone()
            validate_scores(self.tie_break, self.fingerprint, source="tie_break")

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
        scores = read_tsv_scores(path)
        fp = ModelFingerprint.of(model)
        validate_scores(scores, fp, source=str(path))
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
        (`revision`, `subfolder`; `hub_kwargs` go to `huggingface_snapshot_download`, e.g.
        `cache_dir`, `local_files_only`, `token`). `model` is a model (a meta-device one is enough)
        or its `PretrainedConfig`: required for a TSV, which carries no fingerprint, and when given
        the mask is checked against it (`HeadMaskError` naming each mismatch).
        """
        path = Path(source).expanduser()
        if not path.exists() and looks_like_hub_id(str(source)):
            path = snapshot(str(source), revision, subfolder, hub_kwargs)
        elif subfolder:
            path = path / subfolder
        if not path.exists():
            raise HeadMaskError(
                f"{path}: no such head-mask file or folder (give a folder written by HeadMask.save_pretrained, "
                f"a head_mask.json, an {RLKV_AUTHORS_TSV} / {DUO_TSV} file or folder, or a Hub repo id)"
            )
        folder = path if path.is_dir() else None
        if folder is not None:
            path = mask_file_in(path)
        if path.suffix != ".tsv":
            mask = cls.load(path)
            if folder is not None:
                check_folder_tsv(folder, mask.scores)
            if model is not None:
                mask.check_compatible(model)
            return mask
        if model is None:
            raise HeadMaskError(
                f"{path}: a TSV head mask holds scores only; pass the model (or its config, or a meta-device "
                "model) so its geometry can be checked and recorded"
            )
        fields = tsv_fields(path)
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
        atomic_write_text(directory / MODEL_CARD, model_card(self))
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
        return upload_folder(self.save_pretrained, repo_id, private, token, revision, commit_message)

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
        return atomic_write_text(path, tsv_text(self.scores))

    @classmethod
    def load(cls, path: str | os.PathLike) -> HeadMask:
        """Read and validate a JSON head mask written by `save`."""
        path = Path(path)
        return cls.from_dict(read_document(path), source=str(path))

    @classmethod
    def from_dict(cls, doc: Any, source: str = "<dict>") -> HeadMask:
        """Validate and build from the JSON document."""
        return cls(**document_fields(doc, source))

    # use ----------------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.scores.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.scores.shape[1]

    def num_full_heads(self, sparsity: float) -> int:
        """How many KV heads keep a full cache at `sparsity`: round((1 - s) * L * H)."""
        check_sparsity(sparsity)
        return int(round((1.0 - sparsity) * self.scores.numel()))

    def full_heads(self, sparsity: float, min_full_per_layer: int = 0, shards: int = 1) -> torch.Tensor:
        """BoolTensor[L, H_kv]: True where the head keeps a full KV cache at target `sparsity`.

        Heads are ranked by score, equal scores by `tie_break` (when the mask has one), and only then
        towards the lower (layer, head) index, so the result is deterministic. `min_full_per_layer`
        first reserves that many top heads in every layer, then fills the remaining slots globally
        (the total stays round((1 - s) * L * H) unless the reservation alone exceeds it).

        shards: every layer keeps a multiple of `shards` full heads (vLLM's tensor parallelism over that many
        ranks; `rlkv.ranking.select_balanced_heads`): each layer's heads in ranking order form groups of
        `shards`, and the groups of the best mean rank are kept, round(count / shards) of them. The sparsity
        served, 1 - full.sum() / full.numel(), can then differ from `sparsity` by up to shards / 2 heads' worth;
        shards=1 is the plain cut.
        """
        if not 0 <= min_full_per_layer <= self.num_kv_heads:
            raise HeadMaskError(
                f"min_full_per_layer={min_full_per_layer} must be in [0, {self.num_kv_heads}]"
            )
        if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
            raise HeadMaskError(
                f"shards={shards!r}: a positive integer (the tensor-parallel size), 1 for none"
            )
        if self.num_kv_heads % shards:
            raise HeadMaskError(
                f"shards={shards}: the model's {self.num_kv_heads} KV heads per layer do not divide among "
                f"{shards} shards; choose a shard count that divides {self.num_kv_heads}"
            )
        count = self.num_full_heads(sparsity)
        if shards == 1:
            return select_full_heads(self.scores, self.tie_break, count, min_full_per_layer)
        return select_balanced_heads(self.scores, self.tie_break, count, shards, min_full_per_layer)

    def order(self) -> torch.Tensor:
        """LongTensor[L * H_kv, 2]: (layer, head) pairs from least to most important (compression order).

        By score, then `tie_break`; where both tie, the higher (layer, head) index counts as less
        important (so the lower index keeps its full cache first).
        """
        return compression_order(self.scores, self.tie_break)

    def index_decided_ties(self) -> int:
        """How many neighbouring pairs of the ranking are decided by index alone (equal score and tie-break)."""
        return ties_decided_by_index(self.scores, self.tie_break)

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

    @staticmethod
    def from_order(order: torch.Tensor, model: Any, **metadata: Any) -> HeadMask:
        """A mask whose `full_heads(k / N)` compresses exactly the first k heads of `order`.

        order: LongTensor[N, 2] of (layer, head) pairs, first = compressed first (as `order()` returns);
        N = layers x KV heads of `model`, each pair once. `metadata` is stored on the mask.
        """
        fp = ModelFingerprint.of(model)
        n = fp.num_hidden_layers * fp.num_key_value_heads
        order = torch.as_tensor(order, dtype=torch.long)
        flat = order[:, 0] * fp.num_key_value_heads + order[:, 1]
        if order.shape != (n, 2) or sorted(flat.tolist()) != list(range(n)):
            raise ValueError(f"order must list each of the model's {n} (layer, KV head) pairs exactly once")
        scores = torch.empty(n)
        scores[flat] = torch.arange(n, dtype=torch.float32) / max(n - 1, 1)
        return HeadMask(
            scores=scores.view(fp.num_hidden_layers, fp.num_key_value_heads),
            fingerprint=fp,
            metadata=metadata,
        )
