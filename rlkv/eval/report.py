"""report.md and PNG plots, regenerated from results.jsonl alone (matplotlib is imported lazily).

Tables (like RLKV Tables 1, 4-6): pass@1 per method x sparsity and each method's pass@1 difference to
`full` and to `rlkv` with a paired-bootstrap 95% interval (`paired_bootstrap`, also in report.json);
resident KV per method x sparsity (with the largest deviation from the matched target); per benchmark,
error modes on problems the full model solves and generated length against full on the samples both
solve; wall time. Plots: accuracy vs sparsity per method (Figure 5), the head mask's gate heatmap
(Figure 3), error-mode bars (Figure 9), generated length relative to full on commonly-correct samples
(Figure 10).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlkv._io import atomic_write_text
from rlkv.eval.methods import is_mask_name
from rlkv.eval.plots import plot_accuracy, plot_common_length, plot_error_modes, plot_gate_heatmap
from rlkv.eval.results import CONFIG_FILE, RESULTS_FILE, current_results, read_json
from rlkv.eval.sensitivity import ORDER_METHODS, plot_sensitivity
from rlkv.eval.tables import (
    BOOTSTRAP_LEVEL,
    BOOTSTRAP_REFERENCES,
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    Row,
    _cell,
    _methods,
    _sparsities,
    accuracy_table,
    bootstrap_table,
    common_length_table,
    draw_means,
    error_mode_table,
    format_sparsity,
    kv_table,
)

logger = logging.getLogger(__name__)

REPORT_JSON = "report.json"


def _stop_lines(rows: list[Row], benches: list[str], config: dict[str, Any]) -> list[str]:
    """Per benchmark: its stop rule and how often `full` hit max_new_tokens (the protocol's length check)."""
    from rlkv.eval.config import benchmark_cap
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
        cap = benchmark_cap({"max_new_tokens": None, **config}, bench)
        lines.append(
            f"- {bench}: generations stop at EOS"
            + "".join(f", {e}" for e in ends if e)
            + f" or {cap} new tokens"
            + (
                f"; full KV hit that cap on {capped} of {len(full)} ({capped / len(full):.1%})"
                if full
                else ""
            )
        )
    return lines


def _columns(rows: list[Row]) -> tuple[list[float], str, str]:
    """The tables' sparsity columns with their markdown header and rule. A grid of `full` alone has no
    sparsity: one column, s=0 (full KV), where `full`'s rows are recorded."""
    sparsities = _sparsities(rows)
    labels = [f"s={format_sparsity(s)}" for s in sparsities]
    if not sparsities:
        sparsities, labels = [0.0], ["s=0 (full KV)"]
    return sparsities, "| method | " + " | ".join(labels) + " |", "| --- |" + " ---: |" * len(sparsities)


def _outcome_lines(rows: list[Row], bench: str, columns: tuple[list[float], str, str]) -> list[str]:
    """One benchmark's error modes on the problems full solves and its generated lengths against full, in
    the report's `columns` (`_columns`); nothing when no method is compressed."""
    sparsities, header, rule = columns
    compressed = [m for m in _methods(rows) if m != "full"]
    if not compressed:
        return []
    errors, lengths = error_mode_table(rows), common_length_table(rows)
    lines = [
        f"## {bench}: error modes on problems the full model solves (repetitive / overlength / incorrect, of n)",
        "",
        header,
        rule,
    ]
    lines += _table_rows(
        compressed,
        sparsities,
        lambda c: f"{c['repetitive']} / {c['overlength']} / {c['incorrect']} of {c['n']}",
        errors,
    )
    lines += [
        "",
        "Repetitive: the tail is a loop (RepetitionRule: < 10% distinct tokens in the last 400, or an exact "
        "period <= 64 repeated >= 4 times over >= 64 tokens); overlength: hit max_new_tokens; incorrect: "
        "finished with a wrong answer.",
        "",
        f"## {bench}: generated length on the samples both the method and full solve (tokens: method / full (n))",
        "",
        header,
        rule,
    ]
    lines += _table_rows(
        compressed, sparsities, lambda c: f"{c['method']:.0f} / {c['full']:.0f} ({c['n']})", lengths
    )
    lines.append("")
    return lines


def _table_rows(
    methods: list[str],
    sparsities: list[float],
    text: Callable[[Any], str],
    table: dict[tuple[str, float], Any],
) -> list[str]:
    """Markdown rows `| method | cell | ... |` of a (method, sparsity) table; a missing cell is empty."""
    return [
        f"| {method} | "
        + " | ".join("" if (c := table.get((method, s))) is None else text(c) for s in sparsities)
        + " |"
        for method in methods
    ]


def _engine_lines(rows: list[Row]) -> list[str]:
    """Which engine generated each method's rows (rows before engines were recorded: transformers)."""
    by_engine: dict[str, list[str]] = {}
    for r in rows:
        methods = by_engine.setdefault(r.get("engine", "transformers"), [])
        if r["method"] not in methods:
            methods.append(r["method"])
    if list(by_engine) == ["transformers"]:
        return []
    parts = [f"{engine} ({', '.join(methods)})" for engine, methods in by_engine.items()]
    mixed = "vllm" in by_engine and "transformers" in by_engine
    note = "; methods without a vLLM form ran on transformers" if mixed else ""
    return [f"- engine: {'; '.join(parts)}{note}"]


def _dtype_lines(rows: list[Row]) -> list[str]:
    """The dtype the rows were generated in (rows before dtypes were recorded say nothing)."""
    counts: dict[str, int] = {}
    for r in rows:
        if r.get("dtype"):
            counts[r["dtype"]] = counts.get(r["dtype"], 0) + 1
    if len(counts) <= 1:
        return [f"- dtype: {d}" for d in counts]
    parts = ", ".join(f"{d} ({n} rows)" for d, n in counts.items())
    return [f"- dtypes: {parts}: rows of different dtypes differ in their greedy tokens; compare within one"]


def head_mask_form(config: dict[str, Any]) -> str:
    """What the head-mask methods' compressed heads keep, in words, from a run's saved config."""
    sink, window = config.get("sink", 16), config.get("window", 64)
    if config.get("window_only"):
        return f"a sliding window of the last {sink} + {window} tokens, no sink, the prompt windowed too"
    if config.get("window_prefill"):
        return f"sink {sink} + the last {window} tokens, the prompt forward windowed the same way"
    if config.get("protect_prompt"):
        return f"the whole prompt, sink {sink} and the last {window} generated tokens"
    return (
        f"sink {sink} + the last {window} tokens after a full-attention prompt forward (the prompt evictable)"
    )


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
        f"max_new_tokens {config.get('max_new_tokens')}"
        + "".join(f" ({b}: {n})" for b, n in (config.get("max_new_tokens_by_benchmark") or {}).items())
        + "; "
        + (
            f"pass@1 over {config.get('num_samples')} samples at temperature {config.get('temperature')}"
            if config.get("temperature", 0) > 0
            else "greedy pass@1"
        ),
        f"- rows: {len(rows)}; generation wall time {sum(r.get('seconds', 0) for r in rows):.0f} s",
        *_engine_lines(rows),
        *_dtype_lines(rows),
        *(
            [f"- head-mask methods' compressed heads keep {head_mask_form(config)}"]
            if any(is_mask_name(r["method"]) for r in rows)
            else []
        ),
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
    columns = _columns(rows)
    sparsities, header, rule = columns
    for bench in benches:
        brows = [r for r in rows if r["benchmark"] == bench]
        acc = accuracy_table(brows)
        lines += [f"## {bench}: pass@1 (%)", "", header, rule]
        partial = False
        for method, by_s in {**acc, **draw_means(acc)}.items():
            cells = []
            for s in sparsities:
                s_cell = 0.0 if method == "full" else s
                if s_cell not in by_s:  # not run at this sparsity (yet)
                    cells.append("")
                    continue
                text = f"{100 * by_s[s_cell]:.1f}"
                covered = len({r["problem_id"] for r in _cell(brows, method, s_cell)})
                if 0 < covered < n_problems[bench]:
                    text += f" (n={covered} of {n_problems[bench]})"
                    partial = True
                cells.append(text)
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
        lines.append("")
        if partial:
            lines += [
                "n=K of N: only K of the benchmark's N problems have rows for that method yet (a run in "
                "progress); its pass@1 is over those K.",
                "",
            ]
        table = intervals[bench] if intervals is not None else bootstrap_table(brows)
        partial_pairs = False
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
                    if c is None:
                        cells.append("")
                        continue
                    text = f"{100 * c['diff']:+.1f} [{100 * c['low']:+.1f}, {100 * c['high']:+.1f}]"
                    if c["n"] < n_problems[bench]:  # paired over the problems both have so far
                        text += f" (n={c['n']})"
                        partial_pairs = True
                    cells.append(text)
                lines.append(f"| {method} | " + " | ".join(cells) + " |")
            lines.append("")
        if table:
            lines += [
                f"Paired by problem (pass@1 per problem, over its samples), {BOOTSTRAP_RESAMPLES:,} resamples "
                f"of the problems (seed {BOOTSTRAP_SEED}), percentile interval; `{BOOTSTRAP_REFERENCES[1]}` is "
                "compared at the same sparsity."
                + (
                    " (n=K): paired over only the K problems both methods have rows for yet."
                    if partial_pairs
                    else ""
                ),
                "",
            ]

    if num_heads:
        overhead = int(config.get("sink", 16)) + int(config.get("window", 64))
        # per benchmark: their lengths differ, and so does what a budget keeps of them
        for bench in benches:
            bench_rows = [r for r in rows if r["benchmark"] == bench]
            kv = kv_table(bench_rows, num_heads, overhead)
            lines += [
                f"## Resident KV on {bench}: % of a full cache (max deviation from the matched target, "
                "tokens per head)",
                "",
                header,
                rule,
            ]
            lines += _table_rows(
                _methods(bench_rows), sparsities, lambda c: f"{c['kv_percent']:.1f} ({c['max_dev']:.1f})", kv
            )
            lines.append("")

    for bench in benches:
        lines += _outcome_lines([r for r in rows if r["benchmark"] == bench], bench, columns)

    lines += ["## Generation wall time (s)", "", header, rule]
    wall = {
        (method, s): sum(r.get("seconds", 0) for r in cell)
        for method in _methods(rows)
        for s in sparsities
        if (cell := _cell(rows, method, s))
    }
    lines += _table_rows(_methods(rows), sparsities, lambda seconds: f"{seconds:.0f}", wall)
    lines.append("")
    return "\n".join(lines)


def write_report(
    out: str | os.PathLike, head_mask: Any = None, plots: bool = True, keys: set[str] | None = None
) -> Path:
    """Regenerate report.md, report.json (pass@1 and bootstrap intervals) and the PNGs in `out` from the rows
    with one of `keys` (default: those its last run asked for); returns the report.md path."""
    out = Path(out)
    rows = current_results(out, keys)
    if not rows:
        raise ValueError(f"{out / RESULTS_FILE}: no results to report; run `rlkv eval` first")
    config_path = out / CONFIG_FILE
    config = read_json(config_path, what=CONFIG_FILE) if config_path.exists() else {}
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
