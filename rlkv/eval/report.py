"""report.md and PNG plots, regenerated from results.jsonl alone (matplotlib is imported lazily).

Tables (like RLKV Tables 1, 4-6): pass@1 per method x sparsity, resident KV per method x sparsity
(with the largest deviation from the matched target), error modes on problems the full model
solves, mean length of commonly-correct samples, wall time; and each method's pass@1 difference to
`full` and to `rlkv` with a paired-bootstrap 95% interval (`paired_bootstrap`), also in report.json. Plots: accuracy vs sparsity per method
(Figure 5), the head mask's gate heatmap (Figure 3), error-mode bars (Figure 9), mean length of
commonly-correct samples (Figure 10).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from statistics import mean
from typing import Any

from rlkv._io import atomic_write_text
from rlkv.eval.errors import ERROR_MODES
from rlkv.eval.methods import matched_tokens_per_head, random_mask_seed

Row = dict[str, Any]
logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"
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


def _per_problem(cells: list[list[Row]]) -> dict[tuple[str, str], float]:
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
            ref = _per_problem([_cell(rows, reference, s)])
            for name, members in [(m, [m]) for m in methods if m not in ("full", reference)] + list(
                groups.items()
            ):
                values = _per_problem([_cell(rows, m, s) for m in members])
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


def common_length_table(rows: list[Row]) -> dict[float, dict[str, Any]]:
    """Per sparsity: problems every method (and full) solved, and each method's mean generated length on them."""
    methods = _methods(rows)
    out: dict[float, dict[str, Any]] = {}
    for s in _sparsities(rows):
        correct_sets = []
        for m in methods:
            correct_sets.append(
                {(r["benchmark"], r["problem_id"], r["sample"]) for r in _cell(rows, m, s) if r["correct"]}
            )
        common = set.intersection(*correct_sets) if correct_sets else set()
        lengths = {}
        for m in methods:
            vals = [
                r["num_generated_tokens"]
                for r in _cell(rows, m, s)
                if (r["benchmark"], r["problem_id"], r["sample"]) in common
            ]
            if vals:
                lengths[m] = mean(vals)
        out[s] = {"n": len(common), "lengths": lengths}
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


def _fmt_s(s: float) -> str:
    return f"{s:g}"


def _stop_lines(rows: list[Row], benches: list[str], config: dict[str, Any]) -> list[str]:
    """Per benchmark: its stop rule and how often `full` hit max_new_tokens (the protocol's length check)."""
    from rlkv.eval.stopping import stop_rule

    lines = []
    for bench in benches:
        rule = stop_rule(bench, config.get("stop"))
        ends = [
            "the end of the first code block" if rule.code_block else "",
            ", ".join(repr(s) for s in rule.strings),
        ]
        full = [r for r in rows if r["benchmark"] == bench and r["method"] == "full"]
        capped = sum(r.get("finish_reason") == "length" for r in full)
        lines.append(
            f"- {bench}: generations stop at EOS"
            + "".join(f", {e}" for e in ends if e)
            + (f" or max_new_tokens; full KV hit max_new_tokens on {capped} of {len(full)}" if full else "")
        )
    return lines


def render_markdown(
    rows: list[Row],
    config: dict[str, Any],
    num_heads: int | None,
    intervals: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    """The report.md text for `rows` of one run with its saved `config`.

    intervals: `bootstrap_table` of each benchmark's rows (computed here when None).
    """
    lines = ["# rlkv evaluation report", ""]
    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    n_problems = {b: len({r["problem_id"] for r in rows if r["benchmark"] == b}) for b in benches}
    lines += [
        f"- model: `{config.get('model', '?')}`; head mask: `{config.get('head_mask')}`",
        f"- benchmarks: {', '.join(f'{b} ({n} problems)' for b, n in n_problems.items())}; "
        f"max_new_tokens {config.get('max_new_tokens')}; "
        + (
            f"pass@1 over {config.get('num_samples')} samples at temperature {config.get('temperature')}"
            if config.get("temperature", 0) > 0
            else "greedy pass@1"
        ),
        f"- rows: {len(rows)}; generation wall time {sum(r.get('seconds', 0) for r in rows):.0f} s",
        *_stop_lines(rows, benches, config),
        "",
        "**Budget matching** (`budget_rule: "
        + str(config.get("budget_rule", "matched"))
        + "`). "
        + {
            "matched": "At sparsity s a head mask keeps round((1 - s) N) of the N KV heads full and the rest at "
            "sink + window tokens, i.e. (1 - s_eff) T + s_eff (sink + window) KV entries per head on average "
            "(s_eff = the fraction of heads really compressed, T = the row's length). Token-eviction baselines "
            "get exactly that per head: the dynamic budget round((1 - s_eff) T) plus a forced overhead of "
            "round(s_eff (sink + window)) sink/recent tokens. `<mask>+<policy>` methods keep the mask's full "
            "heads and let the policy pick sink + window tokens on the compressed heads. The KV table below "
            "shows the measured deviation from that target (at most one token per head when matched).",
            "paper": "RLKV appendix: baselines get round((1 - s) T) + sink + window tokens per head, "
            "(1 - s_eff)(sink + window) per head more than the head-mask methods.",
            "fixed": f"Baselines keep a fixed {config.get('fixed_budget')} tokens per head (R-KV setting); "
            "not matched to the head-mask methods.",
        }.get(str(config.get("budget_rule", "matched")), ""),
        "",
    ]
    sparsities = _sparsities(rows)
    header = "| method | " + " | ".join(f"s={_fmt_s(s)}" for s in sparsities) + " |"
    rule = "| --- |" + " ---: |" * len(sparsities)
    for bench in benches:
        brows = [r for r in rows if r["benchmark"] == bench]
        acc = accuracy_table(brows)
        lines += [f"## {bench}: pass@1 (%)", "", header, rule]
        for method, by_s in {**acc, **draw_means(acc)}.items():
            cells = [
                f"{100 * by_s.get(0.0 if method == 'full' else s, float('nan')):.1f}" for s in sparsities
            ]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
        table = intervals[bench] if intervals is not None else bootstrap_table(brows)
        for reference in BOOTSTRAP_REFERENCES:
            cells_by = {(c["method"], c["sparsity"]): c for c in table if c["reference"] == reference}
            if not cells_by:
                continue
            lines += [
                f"### {bench}: pass@1 difference to {reference} (points, paired-bootstrap "
                f"{100 * BOOTSTRAP_LEVEL:g}% interval)",
                "",
                header,
                rule,
            ]
            for method in dict.fromkeys(m for m, _ in cells_by):
                cells = []
                for s in sparsities:
                    c = cells_by.get((method, s))
                    cells.append(
                        ""
                        if c is None
                        else f"{100 * c['diff']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
                    )
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
        if table:
            lines += [
                f"Paired by problem (pass@1 per problem, over its samples), {BOOTSTRAP_RESAMPLES:,} resamples "
                f"of the problems (seed {BOOTSTRAP_SEED}), percentile interval; `{BOOTSTRAP_REFERENCES[1]}` is "
                "compared at the same sparsity.",
                "",
            ]

    if num_heads:
        overhead = int(config.get("sink", 16)) + int(config.get("window", 64))
        kv = kv_table(rows, num_heads, overhead)
        lines += [
            "## Resident KV: % of a full cache (max deviation from the matched target, tokens per head)",
            "",
            header,
            rule,
        ]
        for method in _methods(rows):
            cells = []
            for s in sparsities:
                c = kv.get((method, s))
                cells.append("" if c is None else f"{c['kv_percent']:.1f} ({c['max_dev']:.1f})")
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")

    errors = error_mode_table(rows)
    lines += [
        "## Error modes on problems the full model solves (repetitive / overlength / incorrect, of n)",
        "",
        header,
        rule,
    ]
    for method in _methods(rows):
        if method == "full":
            continue
        cells = []
        for s in sparsities:
            c = errors.get((method, s))
            cells.append(
                "" if c is None else f"{c['repetitive']} / {c['overlength']} / {c['incorrect']} of {c['n']}"
            )
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Repetitive: the tail is a loop (RepetitionRule: < 10% distinct tokens in the last 400, or an exact "
        "period <= 64 repeated >= 4 times over >= 64 tokens); overlength: hit max_new_tokens; incorrect: "
        "finished with a wrong answer.",
        "",
    ]

    common = common_length_table(rows)
    lines += ["## Mean generated length of commonly-correct samples (tokens)", "", header, rule]
    for method in _methods(rows):
        cells = []
        for s in sparsities:
            c = common[s]
            v = c["lengths"].get(method)
            cells.append("" if v is None else f"{v:.0f}")
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("| (n common) | " + " | ".join(str(common[s]["n"]) for s in sparsities) + " |")
    lines.append("")

    lines += ["## Generation wall time (s)", "", header, rule]
    for method in _methods(rows):
        cells = [f"{sum(r.get('seconds', 0) for r in _cell(rows, method, s)):.0f}" for s in sparsities]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def plot_accuracy(rows: list[Row], path: Path) -> None:
    """Accuracy vs sparsity, one line per method, one panel per benchmark (RLKV Figure 5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(r["benchmark"] for r in rows))
    fig, axes = plt.subplots(1, len(benches), figsize=(5 * len(benches), 3.8), squeeze=False)
    for ax, bench in zip(axes[0], benches):
        acc = accuracy_table([r for r in rows if r["benchmark"] == bench])
        averaged = {m for members in _draw_groups(acc).values() for m in members}
        shown = {m: v for m, v in acc.items() if m not in averaged}  # one line per averaged group
        for method, by_s in {**shown, **draw_means(acc)}.items():
            if method == "full":
                ax.axhline(100 * by_s[0.0], color="black", linestyle="--", label="full")
                continue
            xs = sorted(by_s)
            ax.plot(xs, [100 * by_s[x] for x in xs], marker="o", label=method)
        ax.set(title=bench, xlabel="sparsity (fraction of KV heads compressed)", ylabel="pass@1 (%)")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_error_modes(rows: list[Row], path: Path) -> None:
    """Stacked error-mode bars per method and sparsity on full-solved problems (RLKV Figure 9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = error_mode_table(rows)
    labels = [f"{m}\ns={_fmt_s(s)}" for m, s in table]
    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(labels) + 2), 4))
    if not table:
        ax.text(
            0.5, 0.5, "no problem solved by the full model", ha="center", va="center", transform=ax.transAxes
        )
    bottom = [0.0] * len(labels)
    for mode in ERROR_MODES:
        vals = [100.0 * c[mode] / c["n"] for c in table.values()]
        ax.bar(labels, vals, bottom=bottom, label=mode)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(ylabel="% of full-solved problems", title="error modes")
    ax.tick_params(axis="x", labelsize=7, rotation=90)
    ax.legend()
    fig.tight_layout()
    _save(fig, path)


def plot_common_length(rows: list[Row], path: Path) -> None:
    """Mean generated length of commonly-correct samples per method vs sparsity (RLKV Figure 10)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    common = common_length_table(rows)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for method in _methods(rows):
        xs = [s for s in common if method in common[s]["lengths"]]
        ax.plot(xs, [common[s]["lengths"][method] for s in xs], marker="o", label=method)
    ax.set(xlabel="sparsity", ylabel="mean generated tokens", title="commonly-correct samples")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def plot_gate_heatmap(scores: Any, path: Path, title: str = "head mask scores") -> None:
    """Heatmap of a head mask's scores [L, H_kv] (RLKV Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [list(map(float, row)) for row in scores.tolist()]
    fig, ax = plt.subplots(figsize=(max(3.0, 0.5 * len(data[0]) + 2), max(3.0, 0.25 * len(data) + 1.5)))
    image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set(xlabel="KV head", ylabel="layer", title=title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    _save(fig, path)


def _save(fig: Any, path: Path) -> None:
    """Save atomically (temp file + rename) and close the figure."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_report(out: str | os.PathLike, head_mask: Any = None, plots: bool = True) -> Path:
    """Regenerate report.md, report.json (pass@1 and bootstrap intervals) and the PNGs in `out` from the rows
    its last run asked for; returns the report.md path."""
    from rlkv.eval.runner import CONFIG_FILE, RESULTS_FILE, current_results
    from rlkv.eval.sensitivity import ORDER_METHODS, plot_sensitivity

    out = Path(out)
    rows = current_results(out)
    if not rows:
        raise ValueError(f"{out / RESULTS_FILE}: no results to report; run `rlkv eval` first")
    config_path = out / CONFIG_FILE
    config = json.loads(config_path.read_text()) if config_path.exists() else {}
    num_heads = None
    if head_mask is not None:
        num_heads = int(head_mask.scores.numel())
    elif rows[0].get("kv_tokens") and rows[0].get("kv_tokens_per_head"):
        num_heads = round(rows[0]["kv_tokens"] / rows[0]["kv_tokens_per_head"])
    summary: dict[str, Any] = {
        "bootstrap": {
            "resamples": BOOTSTRAP_RESAMPLES,
            "seed": BOOTSTRAP_SEED,
            "level": BOOTSTRAP_LEVEL,
            "paired_by": "problem",
        },
        "benchmarks": {},
    }
    intervals = {}
    for bench in dict.fromkeys(r["benchmark"] for r in rows):
        brows = [r for r in rows if r["benchmark"] == bench]
        intervals[bench] = bootstrap_table(brows)
        acc = accuracy_table(brows)
        summary["benchmarks"][bench] = {
            "pass_at_1": {
                m: {f"{s:g}": v for s, v in by_s.items()} for m, by_s in {**acc, **draw_means(acc)}.items()
            },
            "differences": intervals[bench],
        }
    text = render_markdown(rows, config, num_heads, intervals)
    atomic_write_text(out / REPORT_JSON, json.dumps(summary, indent=1) + "\n")
    if plots and importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: report.md without plots (pip install 'rlkv[plots]')")
        plots = False
    if plots:
        plot_accuracy(rows, out / "accuracy_vs_sparsity.png")
        plot_error_modes(rows, out / "error_modes.png")
        plot_common_length(rows, out / "common_length.png")
        figures = ["accuracy_vs_sparsity.png", "error_modes.png", "common_length.png"]
        if head_mask is not None:
            plot_gate_heatmap(head_mask.scores, out / "gate_heatmap.png")
            figures.append("gate_heatmap.png")
        if sum(m in ORDER_METHODS for m in _methods(rows)) >= 2 and len(_sparsities(rows)) >= 3:
            plot_sensitivity(rows, out / "sensitivity.png")
            figures.append("sensitivity.png")
        text += "\n## Figures\n\n" + "\n".join(f"![{f[:-4]}]({f})" for f in figures) + "\n"
    return atomic_write_text(out / "report.md", text)
