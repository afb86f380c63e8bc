"""The report's tables, computed from result rows alone: pass@1, paired-bootstrap intervals, error
modes, common-length means and resident KV per method x sparsity (rendered by `rlkv.eval.report`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from statistics import mean
from typing import Any

from rlkv.eval.error_modes import ERROR_MODES
from rlkv.eval.methods import matched_tokens_per_head, random_mask_seed

Row = dict[str, Any]

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 0
BOOTSTRAP_LEVEL = 0.95
# methods every other method is compared with (paired by problem), `rlkv` at the same sparsity
BOOTSTRAP_REFERENCES = ("full", "rlkv")


def _methods(rows: list[Row]) -> list[str]:
    """Methods in first-seen order, `full` first."""
    seen = list(dict.fromkeys(r["method"] for r in rows))
    return sorted(seen, key=lambda m: m != "full")


def _sparsities(rows: list[Row]) -> list[float]:
    return sorted({r["sparsity"] for r in rows if r["method"] != "full"})


def _cell(rows: list[Row], method: str, sparsity: float) -> list[Row]:
    if method == "full":
        return [r for r in rows if r["method"] == "full"]
    return [r for r in rows if r["method"] == method and r["sparsity"] == sparsity]


def accuracy_table(rows: list[Row]) -> dict[str, dict[float, float]]:
    """pass@1 (mean correctness over problems and samples) per method and sparsity (`full` at 0 only)."""
    table: dict[str, dict[float, float]] = defaultdict(dict)
    for method in _methods(rows):
        for s in [0.0] if method == "full" else _sparsities(rows):
            cell = _cell(rows, method, s)
            if cell:
                table[method][s] = mean(float(r["correct"]) for r in cell)
    return table


def _draw_groups(methods) -> dict[str, list[str]]:
    """Seeded random-mask draws by method without the seed (`random-mask@3+rkv` -> `random-mask+rkv`),
    for the methods drawn two or more times."""
    groups: dict[str, list[str]] = defaultdict(list)
    for method in methods:
        mask, plus, policy = method.partition("+")
        if random_mask_seed(mask) is not None:
            groups["random-mask" + plus + policy].append(method)
    return {group: members for group, members in groups.items() if len(members) >= 2}


def draw_means(table: dict[str, dict[float, float]]) -> dict[str, dict[float, float]]:
    """Mean over seeded draws: `random-mask@0`, `random-mask@1`, ... (and `+<policy>` variants) averaged
    into one row named like `random-mask (mean of 2 draws)`, for every method with two or more draws."""
    means = {}
    for group, members in _draw_groups(table).items():
        shared = set.intersection(*(set(table[m]) for m in members))
        means[f"{group} (mean of {len(members)} draws)"] = {
            s: mean(table[m][s] for m in members) for s in sorted(shared)
        }
    return means


def paired_bootstrap(
    differences: Sequence[float],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = BOOTSTRAP_LEVEL,
) -> tuple[float, float, float]:
    """Mean of paired per-problem `differences` and its percentile bootstrap interval: (mean, low, high).

    Each of `resamples` (seeded) draws n problems with replacement and takes the mean difference;
    low / high are the (1 - level) / 2 and (1 + level) / 2 percentiles of those means (linear interpolation).
    """
    import numpy as np

    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size == 0:
        raise ValueError("paired_bootstrap needs a non-empty list of per-problem differences")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"resamples={resamples} must be >= 1 and level={level} in (0, 1)")
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 22) // d.size)  # index draws held at once (32 MiB)
    means = np.concatenate(
        [
            d[rng.integers(0, d.size, size=(min(block, resamples - start), d.size))].mean(axis=1)
            for start in range(0, resamples, block)
        ]
    )
    low, high = np.percentile(means, [50.0 * (1.0 - level), 50.0 * (1.0 + level)])
    return float(d.mean()), float(low), float(high)


def rank_correlation(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rank correlation of paired values (ties get their mean rank); nan for fewer than 3 pairs or a
    constant side."""
    import numpy as np

    if len(x) != len(y):
        raise ValueError(f"rank_correlation needs paired values, got {len(x)} and {len(y)}")
    if len(x) < 3:
        return float("nan")

    def ranks(values: Sequence[float]) -> np.ndarray:
        v = np.asarray(values, dtype=np.float64)
        order = np.argsort(v, kind="stable")
        r = np.empty(len(v))
        r[order] = np.arange(len(v), dtype=np.float64)
        for value in np.unique(v):  # ties: the mean of their ranks
            tied = v == value
            r[tied] = r[tied].mean()
        return r

    a, b = ranks(x), ranks(y)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def per_problem(cells: list[list[Row]]) -> dict[tuple[str, str], float]:
    """pass@1 per (benchmark, problem id), averaged over samples and over the methods of `cells`
    (a draw group's mean), for the problems every cell has."""
    by_cell = []
    for cell in cells:
        outcomes: dict[tuple[str, str], list[float]] = defaultdict(list)
        for r in cell:
            outcomes[(r["benchmark"], r["problem_id"])].append(float(r["correct"]))
        by_cell.append({k: mean(v) for k, v in outcomes.items()})
    shared = set.intersection(*(set(c) for c in by_cell)) if by_cell else set()
    return {k: mean(c[k] for c in by_cell) for k in shared}


def bootstrap_table(
    rows: list[Row],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    level: float = BOOTSTRAP_LEVEL,
) -> list[dict[str, Any]]:
    """pass@1 difference of each method (and draw mean) x sparsity to `full` and to `rlkv` (same sparsity),
    paired by problem, with `paired_bootstrap` intervals: dicts of method, sparsity, reference, n
    (problems both have), diff, low, high (fractions)."""
    methods = _methods(rows)
    groups = {f"{g} (mean of {len(m)} draws)": m for g, m in _draw_groups(methods).items()}
    out = []
    for reference in BOOTSTRAP_REFERENCES:
        if reference not in methods:
            continue
        for s in _sparsities(rows):
            ref = per_problem([_cell(rows, reference, s)])
            for name, members in [(m, [m]) for m in methods if m not in ("full", reference)] + list(
                groups.items()
            ):
                values = per_problem([_cell(rows, m, s) for m in members])
                shared = sorted(set(values) & set(ref))
                if not shared:
                    continue
                diff, low, high = paired_bootstrap(
                    [values[k] - ref[k] for k in shared], resamples=resamples, seed=seed, level=level
                )
                out.append(
                    {
                        "method": name,
                        "sparsity": s,
                        "reference": reference,
                        "n": len(shared),
                        "diff": diff,
                        "low": low,
                        "high": high,
                    }
                )
    return out


def _solved_by_full(rows: list[Row]) -> set[tuple[str, str, int]]:
    return {
        (r["benchmark"], r["problem_id"], r["sample"]) for r in rows if r["method"] == "full" and r["correct"]
    }


def error_mode_table(rows: list[Row]) -> dict[tuple[str, float], dict[str, int]]:
    """Error-mode counts of each (method, sparsity) on the problems the full model solves (plus `n`)."""
    solved = _solved_by_full(rows)
    table: dict[tuple[str, float], dict[str, int]] = {}
    for method in _methods(rows):
        if method == "full":
            continue
        for s in _sparsities(rows):
            cell = [
                r for r in _cell(rows, method, s) if (r["benchmark"], r["problem_id"], r["sample"]) in solved
            ]
            if cell:
                counts = {mode: sum(r["error_mode"] == mode for r in cell) for mode in ERROR_MODES}
                table[(method, s)] = {"n": len(cell), **counts}
    return table


def common_length_table(rows: list[Row]) -> dict[tuple[str, float], dict[str, Any]]:
    """Per (method, sparsity): mean generated tokens of the method and of `full` on the samples both solved
    (n of them); methods that solved none of full's samples have no entry.

    Pairwise with `full` rather than over the samples every method solved: one baseline that solves
    nothing would empty the latter at its sparsity.
    """
    full_tokens = {
        (r["benchmark"], r["problem_id"], r["sample"]): r["num_generated_tokens"]
        for r in _cell(rows, "full", 0.0)
        if r["correct"]
    }
    out: dict[tuple[str, float], dict[str, Any]] = {}
    for method in _methods(rows):
        if method == "full":
            continue
        for s in _sparsities(rows):
            pairs = [
                (r["num_generated_tokens"], full_tokens[k])
                for r in _cell(rows, method, s)
                if r["correct"] and (k := (r["benchmark"], r["problem_id"], r["sample"])) in full_tokens
            ]
            if pairs:
                out[(method, s)] = {
                    "n": len(pairs),
                    "method": mean(m for m, _ in pairs),
                    "full": mean(f for _, f in pairs),
                }
    return out


def kv_table(rows: list[Row], num_heads: int, overhead: int) -> dict[tuple[str, float], dict[str, float]]:
    """Per (method, sparsity): resident KV as % of full, and max |KV tokens per head - matched target|."""
    table = {}
    for method in _methods(rows):
        for s in _sparsities(rows) or [0.0]:
            cell = [r for r in _cell(rows, method, s) if r.get("kv_tokens") is not None]
            if not cell:
                continue
            full = sum(r["logical_length"] * num_heads for r in cell)
            target_s = 0.0 if method == "full" else s
            dev = max(
                abs(
                    r["kv_tokens_per_head"]
                    - matched_tokens_per_head(target_s, num_heads, r["logical_length"], overhead)
                )
                for r in cell
            )
            table[(method, s)] = {
                "kv_percent": 100.0 * sum(r["kv_tokens"] for r in cell) / max(full, 1),
                "max_dev": dev,
                "kv_mib": mean(r["kv_bytes"] for r in cell) / 2**20,
            }
    return table


def format_sparsity(s: float) -> str:
    return f"{s:g}"
