"""Head masks on the Hugging Face Hub: what a repo id looks like, fetching a mask's files, uploading a
mask folder, and the model card written beside it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rlkv.head_mask.fingerprint import HeadMaskError
from rlkv.head_mask.formats import DUO_CONFIG, DUO_TSV, MASK_JSON, MASK_TSV, RLKV_AUTHORS_TSV


def looks_like_hub_id(text: str) -> bool:
    """`owner/name`: two non-empty parts without path syntax (what a Hub repo id looks like)."""
    parts = text.split("/")
    return (
        len(parts) == 2
        and all(parts)
        and not text.startswith((".", "~"))
        and all(c.isalnum() or c in "-_." for c in text.replace("/", ""))
    )


def snapshot(repo_id: str, revision: str | None, subfolder: str | None, hub_kwargs: dict[str, Any]) -> Path:
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


def upload_folder(
    save: Any, repo_id: str, private: bool | None, token: str | None, revision: str | None, message: str
) -> Any:
    """Create the model repo if missing and upload the folder `save(tmp_dir)` writes; the commit info."""
    import tempfile

    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        save(tmp)
        return api.upload_folder(folder_path=tmp, repo_id=repo_id, revision=revision, commit_message=message)


def model_card(mask: Any) -> str:
    """The README.md of a mask folder (`HeadMask.save_pretrained`): Hub metadata, geometry, how the
    scores were made, full heads by sparsity, how ties rank, and how to load it."""
    fp = mask.fingerprint
    # the Hub id of the base model: recorded explicitly (a mask of a local copy), else the
    # fingerprint's name when it is one (not when it names a folder on this machine)
    named = (
        fp.name_or_path if looks_like_hub_id(fp.name_or_path) and not Path(fp.name_or_path).exists() else ""
    )
    base = str(mask.metadata.get("base_model") or named)
    header = ["---", "library_name: rlkv", "tags:", "- rlkv", "- kv-cache", "- head-mask"]
    header += [f"base_model: {base}"] if base else []
    header += ["---", ""]
    counts = ", ".join(f"s={s}: {mask.num_full_heads(s)} full" for s in (0.25, 0.5, 0.75, 0.875))
    body = f"""# rlkv head mask for {fp.name_or_path or fp.model_type}

One score per (layer, KV head) in [0, 1]: how much that head needs a full KV cache, {_provenance(mask)}.

- geometry: {fp.model_type}, {fp.num_hidden_layers} layers x {fp.num_key_value_heads} KV heads, head_dim {fp.head_dim}
- trained with sink {mask.train_sink} / local {mask.train_local}; \
inference sink {mask.inference_sink} / local {mask.inference_local}
- full KV heads by sparsity: {counts}
- {_ranking_line(mask)}

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


def _provenance(mask: Any) -> str:
    """How the scores were made, for the card."""
    if mask.metadata.get("method") == "ablation":
        text = (
            "scored by `rlkv ablation-mask` (the teacher-forced NLL increase when that head alone "
            "runs sink + local attention, min-max scaled; raw increases in the metadata's `delta_nll`)"
        )
    else:
        text = "learned by RLKV gates (or imported)"
    search = mask.metadata.get("cut_search")
    if search:
        cuts = ", ".join(f"s={c['sparsity']:g}" for c in search["searches"])
        text += (
            f"; then its cut at {cuts} refined by a swap search on the heads' joint teacher-forced NLL "
            "(`rlkv refine-mask`; the scores are ranks, the search in the metadata's `cut_search`)"
        )
    elimination = mask.metadata.get("elimination")
    if elimination:
        text += (
            f"; then ranked from its s={elimination['start']:g} set to s={elimination['stop']:g} by a backward "
            "elimination on the heads' joint teacher-forced NLL (`rlkv search-mask`, "
            f"{elimination['shards']} shard(s); the scores are ranks, the rounds in the metadata's `elimination`)"
        )
    return text


def _ranking_line(mask: Any) -> str:
    """The card's line on how heads with equal scores are ranked."""
    import torch

    counts = torch.unique(mask.scores, return_counts=True)[1]
    tied = int(counts[counts > 1].sum())
    if mask.tie_break is None:
        return f"ranking: by score; {tied} heads share a score with another, ranked by (layer, head) index"
    source = mask.metadata.get("tie_break", "tie_break")
    return (
        f"ranking: by score; the {tied} heads that share a score with another by `tie_break` ({source}); "
        f"pairs decided by index alone: {mask.index_decided_ties()}"
    )
