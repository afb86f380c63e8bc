"""Resuming an eval folder: the settings that change rows, saved in eval_config.json and checked on a rerun.

A rerun may change the grid (benchmarks, methods, sparsities, ...: `RESUME_FREE_FIELDS`) but not what a row
depends on (model, caps, budget rule, engine, each mask's full heads at the rows' sparsities).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import MISSING, asdict, fields
from pathlib import Path
from typing import Any

from rlkv._io import atomic_write_text
from rlkv.errors import UserInputError
from rlkv.eval.config import RESUME_FREE_FIELDS, EvalConfig, benchmark_cap
from rlkv.eval.methods import MASK_FIELDS, parse_method
from rlkv.eval.results import CONFIG_FILE, RESULTS_FILE, read_json, read_results


def mask_digest(path: str | os.PathLike) -> str | None:
    """sha1 of what defines a head mask at `path`: the file, or a folder's head_mask.json (else its TSVs).

    A mask card (README.md) rewritten with an eval table leaves it unchanged; None: nothing to hash.
    """
    path = Path(path)
    if path.is_file():
        files = [path]
    elif (path / "head_mask.json").is_file():
        files = [path / "head_mask.json"]
    else:
        files = sorted(path.glob("*.tsv")) if path.is_dir() else []
    if len(files) == 1:  # a mask file's digest as eval_config.json has always recorded it
        return hashlib.sha1(files[0].read_bytes()).hexdigest()
    digest = hashlib.sha1()
    for f in files:
        digest.update(f.name.encode() + b"\x00" + f.read_bytes())
    return digest.hexdigest() if files else None


def mask_layouts(path: str | os.PathLike, sparsities: Iterable[float], model: Any = None) -> dict[str, str]:
    """The full heads of the mask at `path` at each sparsity, as `{"0.75": "9.1 10.1 11.0 ..."}`
    ("layer.head", in order): all that a mask method's rows depend on (the eval sets sink and window).

    model: the evaluated model (or its config); required when `path` is a scores-only TSV or TSV folder.
    """
    from rlkv.head_mask import HeadMask

    mask = HeadMask.from_pretrained(path, model)
    layouts = {}
    for s in sparsities:
        full = mask.full_heads(float(s)).nonzero().tolist()
        layouts[_sparsity_key(s)] = " ".join(f"{layer}.{head}" for layer, head in full)
    return layouts


def _sparsity_key(sparsity: float) -> str:
    return f"{float(sparsity):g}"


def check_resume(out: Path, cfg: EvalConfig, model: Any = None) -> None:
    """Refuse to add rows to `out` made with other settings than its saved ones; then save `cfg`'s."""
    path = out / CONFIG_FILE
    rows = read_results(out / RESULTS_FILE) if path.exists() else []
    current = _settings(cfg, {r["sparsity"] for r in rows}, model)
    saved = read_json(path, what=CONFIG_FILE) if path.exists() else {}
    current["hosts"] = saved.get("hosts", [])
    if rows:
        saved = _upgraded(saved, cfg, current)
        diff = _differences(saved, current, cfg, rows)
        if diff:
            raise UserInputError(
                f"{out}: results there were made with other settings ({'; '.join(diff)} differ); "
                "use another --out or the same settings to resume"
            )
    atomic_write_text(path, json.dumps(current, indent=1, sort_keys=True) + "\n")


def record_host(out: Path, device: Any) -> str:
    """Add this machine (`host_description`) to `eval_config.json`'s `hosts`, the machines its rows were
    generated on: greedy bf16 results differ across CPUs, so cells compare within one host only."""
    from rlkv.inference.dtypes import host_description

    host = host_description(device)
    path = out / CONFIG_FILE
    settings = read_json(path, what=CONFIG_FILE)
    if host not in settings.setdefault("hosts", []):
        settings["hosts"].append(host)
        atomic_write_text(path, json.dumps(settings, indent=1, sort_keys=True) + "\n")
    return host


def _settings(cfg: EvalConfig, row_sparsities: set[float] = frozenset(), model: Any = None) -> dict[str, Any]:
    """The fields of `cfg` that change results, plus each mask's digest (a retrained mask at the same
    path changes results too) and its full heads at the sparsities of `cfg` and of `row_sparsities`
    (`model` reads a scores-only TSV mask)."""
    current = {k: v for k, v in asdict(cfg).items() if k not in RESUME_FREE_FIELDS}
    sparsities = sorted({*map(float, cfg.sparsities), *row_sparsities} - {0.0})
    for name in MASK_FIELDS.values():
        source = getattr(cfg, name)
        digest = mask_digest(source) if source else None
        if digest:
            current[f"{name}_sha1"] = digest
            current[f"{name}_layouts"] = mask_layouts(source, sparsities, model)
    return current


def _upgraded(saved: dict[str, Any], cfg: EvalConfig, current: dict[str, Any]) -> dict[str, Any]:
    """A settings file saved by an older rlkv, completed with what its runs did for fields it lacks."""
    for f in fields(EvalConfig):  # fields added later: their runs had the default's behaviour
        if f.name not in saved and f.name in current and f.name != "stop":
            saved[f.name] = f.default_factory() if f.default_factory is not MISSING else f.default
    if "stop" not in saved and not any(cfg.stop_rule(b) for b in cfg.benchmarks):
        saved["stop"] = current["stop"]  # saved before stop rules existed: none applied, as now
    for name in MASK_FIELDS.values():
        if f"{name}_sha1" not in saved and saved.get(name) == current.get(name):
            saved[f"{name}_sha1"] = current.get(f"{name}_sha1")  # saved before folders were hashed
        same_file = all(saved.get(k) == current.get(k) for k in (name, f"{name}_sha1"))
        if f"{name}_layouts" not in saved and same_file:
            saved[f"{name}_layouts"] = current.get(f"{name}_layouts")  # saved before layouts were recorded
    return saved


def _differences(
    saved: dict[str, Any], current: dict[str, Any], cfg: EvalConfig, rows: list[dict[str, Any]]
) -> list[str]:
    """The settings whose change would mix results. Caps compare per benchmark that has rows, masks
    per method that has rows: a cap or a mask that no row was made with changes no row."""
    per_row = {"max_new_tokens", "max_new_tokens_by_benchmark", "hosts"}
    for name in MASK_FIELDS.values():
        per_row |= {name, f"{name}_sha1", f"{name}_layouts"}
    diff = sorted(k for k in set(saved) | set(current) if k not in per_row and saved.get(k) != current.get(k))
    diff += sorted(
        f"max_new_tokens of {bench}"
        for bench in {r["benchmark"] for r in rows}
        if benchmark_cap(saved, bench) != cfg.new_tokens(bench)
    )
    for mask, name in MASK_FIELDS.items():
        made_with = [r for r in rows if parse_method(r["method"]).mask == mask]
        stale = sorted({r["method"] for r in made_with})
        if stale and _mask_changed(saved, current, name, {r["sparsity"] for r in made_with}):
            diff.append(
                f"{name} (the mask of the rows of {', '.join(stale)}: drop them with "
                f"--redo {','.join(stale)} to rerun them with the new mask)"
            )
    return diff


def _mask_changed(saved: dict[str, Any], current: dict[str, Any], name: str, sparsities: set[float]) -> bool:
    """Whether the rows at `sparsities` were made with other full heads than the mask `name` has now.

    Where both settings record the layouts at those sparsities, only they count: a mask re-saved with
    new metadata, a card or a tie-break below the cut still matches its rows. Else the path and digest.
    """
    keys = {_sparsity_key(s) for s in sparsities}
    old, new = saved.get(f"{name}_layouts") or {}, current.get(f"{name}_layouts") or {}
    if keys <= old.keys() and keys <= new.keys():
        return any(old[k] != new[k] for k in keys)
    return any(saved.get(k) != current.get(k) for k in (name, f"{name}_sha1"))
