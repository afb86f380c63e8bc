"""Paired comparison of two methods' rows, possibly from two `rlkv eval` folders (same problems, same host type).

`compare_cells(a, b)` pairs the rows of cell `a` and cell `b` by (benchmark, problem id), averages
samples, and gives per benchmark (and over all of them) the pass@1 of each and the mean difference
a - b with its paired-bootstrap interval (`rlkv.eval.tables.paired_bootstrap`). A cell is
`FOLDER:METHOD[@SPARSITY]` (`parse_cell`); `rlkv compare` prints the table.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

from rlkv.errors import UserInputError
from rlkv.eval.results import RESULTS_FILE, ROWS_ARCHIVE, read_results
from rlkv.eval.tables import paired_bootstrap, per_problem


@dataclass(frozen=True)
class Cell:
    """One method (at one sparsity; None: its only one) of an eval folder."""

    folder: Path
    method: str
    sparsity: float | None = None

    @property
    def label(self) -> str:
        at = "" if self.sparsity is None else f"@{self.sparsity:g}"
        return f"{self.folder.name}:{self.method}{at}"


def parse_cell(text: str) -> Cell:
    """`FOLDER:METHOD[@SPARSITY]` (e.g. `results/eval/run:rlkv@0.75`, `run:random-mask@0@0.75`) as a `Cell`."""
    folder, sep, spec = text.rpartition(":")
    if not sep or not folder or not spec:
        raise UserInputError(
            f"{text!r}: write a cell as FOLDER:METHOD[@SPARSITY], e.g. results/eval/run:rlkv@0.75"
        )
    # a seeded draw's method holds an '@' itself (random-mask@0): its sparsity is after the last one
    method, at, sparsity = spec.rpartition("@") if spec.count("@") > 1 else spec.partition("@")
    value = None
    if at:
        try:
            value = float(sparsity)
        except ValueError:
            raise UserInputError(f"{text!r}: the sparsity after '@' must be a number, e.g. @0.75") from None
    return Cell(Path(folder), method, value)


def hosts(folder: str | os.PathLike) -> list[str]:
    """The machines an eval folder's rows came from (`eval_config.json`'s `hosts`; [] when unknown)."""
    path = Path(folder) / "eval_config.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text(encoding="utf-8")).get("hosts", []))


def folder_rows(folder: Path) -> list[dict[str, Any]]:
    """Every row of an eval folder, one per key (the first written), whichever run asked for it."""
    if not (folder / RESULTS_FILE).exists() and not (folder / ROWS_ARCHIVE).exists():
        raise UserInputError(f"{folder}: no {RESULTS_FILE} (an `rlkv eval --out` folder is needed)")
    rows: dict[str, dict[str, Any]] = {}
    for row in read_results(folder / RESULTS_FILE):
        rows.setdefault(row["key"], row)
    return list(rows.values())


def cell_outcomes(cell: Cell) -> dict[tuple[str, str], float]:
    """pass@1 per (benchmark, problem id) of `cell` (the mean over its samples)."""
    every = folder_rows(cell.folder)
    rows = [r for r in every if r["method"] == cell.method]
    sparsities = sorted({r["sparsity"] for r in rows})
    if cell.sparsity is not None:
        rows = [r for r in rows if abs(r["sparsity"] - cell.sparsity) < 1e-9]
    elif len(sparsities) > 1:
        raise UserInputError(
            f"{cell.label}: the method has rows at sparsities {sparsities}; name one as METHOD@SPARSITY"
        )
    if not rows:
        have = sorted({(r["method"], r["sparsity"]) for r in every})
        raise UserInputError(f"{cell.label}: no rows; the folder has (method, sparsity) {have}")
    return per_problem([rows])


def compare_cells(a: Cell, b: Cell, resamples: int = 10_000, seed: int = 0) -> list[dict[str, Any]]:
    """Per benchmark and over all (benchmark "all"): n shared problems, solved counts (sample means
    summed), pass@1 of a and b, and a - b with its 95% paired-bootstrap interval (fractions)."""
    left, right = cell_outcomes(a), cell_outcomes(b)
    shared = sorted(set(left) & set(right))
    if not shared:
        raise UserInputError(f"{a.label} and {b.label} share no (benchmark, problem id)")
    benchmarks = sorted({bench for bench, _ in shared})
    groups = [(bench, [k for k in shared if k[0] == bench]) for bench in benchmarks]
    if len(groups) > 1:
        groups.append(("all", shared))
    table = []
    for bench, keys in groups:
        diff, low, high = paired_bootstrap([left[k] - right[k] for k in keys], resamples=resamples, seed=seed)
        table.append(
            {
                "benchmark": bench,
                "n": len(keys),
                "a_solved": sum(left[k] for k in keys),
                "b_solved": sum(right[k] for k in keys),
                "a": mean(left[k] for k in keys),
                "b": mean(right[k] for k in keys),
                "diff": diff,
                "low": low,
                "high": high,
            }
        )
    return table


def format_comparison(a: Cell, b: Cell, table: list[dict[str, Any]]) -> str:
    """The comparison as a markdown table (points = percent of problems)."""
    lines = [
        f"a = {a.label}, b = {b.label}",
        "",
        "| benchmark | n | a solved | b solved | a pass@1 | b pass@1 | a - b [95% CI] |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in table:
        lines.append(
            f"| {row['benchmark']} | {row['n']} | {row['a_solved']:g} | {row['b_solved']:g} | "
            f"{100 * row['a']:.1f}% | {100 * row['b']:.1f}% | "
            f"{100 * row['diff']:+.1f} [{100 * row['low']:+.1f}, {100 * row['high']:+.1f}] |"
        )
    ha, hb = hosts(a.folder), hosts(b.folder)
    if ha and hb and set(ha) != set(hb):
        lines += ["", f"warning: the folders' hosts differ ({ha} vs {hb}); greedy rows differ across CPUs"]
    return "\n".join(lines)
