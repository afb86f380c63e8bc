"""report.md tables from a constructed results.jsonl: accuracy, error modes on full-solved problems, common lengths."""

import itertools
import json
from fractions import Fraction

import pytest

from rlkv.eval.report import REPORT_JSON, render_markdown, write_report
from rlkv.eval.results import CONFIG_FILE, RESULTS_FILE
from rlkv.eval.tables import (
    accuracy_table,
    common_length_table,
    draw_means,
    error_mode_table,
    kv_table,
    paired_bootstrap,
)


def _row(problem, method, sparsity, correct, tokens, error=None, finish="eos", sample=0, length=200):
    heads = 4
    per_head = length if method == "full" else (1 - sparsity) * length + sparsity * 80
    return {
        "key": f"b|{problem}|{method}|{sparsity:g}|{sample}",
        "benchmark": "b",
        "problem_id": problem,
        "method": method,
        "sparsity": sparsity,
        "sample": sample,
        "correct": correct,
        "num_generated_tokens": tokens,
        "finish_reason": finish,
        "error_mode": error,
        "logical_length": length,
        "kv_tokens": int(per_head * heads),
        "kv_tokens_per_head": per_head,
        "kv_bytes": int(per_head * heads) * 128,
        "seconds": 0.5,
    }


ROWS = [
    # full solves p1, p2, p3; fails p4
    _row("p1", "full", 0.0, True, 100),
    _row("p2", "full", 0.0, True, 120),
    _row("p3", "full", 0.0, True, 140),
    _row("p4", "full", 0.0, False, 300, "overlength", "length"),
    # rlkv at 0.5: solves p1, p2 (longer), loops on p3, solves p4
    _row("p1", "rlkv", 0.5, True, 110),
    _row("p2", "rlkv", 0.5, True, 150),
    _row("p3", "rlkv", 0.5, False, 300, "repetitive", "repetition"),
    _row("p4", "rlkv", 0.5, True, 200),
    # rkv at 0.5: solves p1 only
    _row("p1", "rkv", 0.5, True, 130),
    _row("p2", "rkv", 0.5, False, 300, "overlength", "length"),
    _row("p3", "rkv", 0.5, False, 90, "incorrect"),
    _row("p4", "rkv", 0.5, False, 80, "incorrect"),
]


def test_accuracy_error_modes_and_common_lengths():
    acc = accuracy_table(ROWS)
    assert acc["full"] == {0.0: 0.75}
    assert acc["rlkv"][0.5] == 0.75 and acc["rkv"][0.5] == 0.25
    errors = error_mode_table(ROWS)
    # only p1..p3 (solved by full) count; p4's rkv failure is not an error mode of compression
    assert errors[("rlkv", 0.5)] == {"n": 3, "repetitive": 1, "overlength": 0, "incorrect": 0}
    assert errors[("rkv", 0.5)] == {"n": 3, "repetitive": 0, "overlength": 1, "incorrect": 1}
    lengths = common_length_table(ROWS)
    # each method against full on the samples both solve: rlkv p1, p2; rkv p1 only
    assert lengths[("rlkv", 0.5)] == {"n": 2, "method": 130, "full": 110}
    assert lengths[("rkv", 0.5)] == {"n": 1, "method": 130, "full": 100}
    kv = kv_table(ROWS, num_heads=4, overhead=80)
    assert kv[("rlkv", 0.5)]["kv_percent"] == pytest.approx(100 * (0.5 * 200 + 40) / 200)
    assert kv[("rlkv", 0.5)]["max_dev"] == pytest.approx(0.0)


def test_pass_at_one_averages_samples():
    rows = [_row("p1", "full", 0.0, c, 50, sample=k) for k, c in enumerate([True, False, True, True])]
    assert accuracy_table(rows)["full"][0.0] == 0.75


def test_seeded_random_mask_draws_are_averaged_in_the_report(tmp_path):
    draws = {"random-mask@0": [True, False, False, False], "random-mask@1": [True, True, True, False]}
    rows = ROWS + [
        _row(f"p{i + 1}", method, 0.5, correct, 100)
        for method, outcomes in draws.items()
        for i, correct in enumerate(outcomes)
    ]
    rows += [_row(f"p{i + 1}", "random-mask@0+rkv", 0.5, True, 100) for i in range(4)]  # one draw: no mean
    acc = accuracy_table(rows)
    assert draw_means(acc) == {"random-mask (mean of 2 draws)": {0.5: pytest.approx(0.5)}}
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path).read_text()
    assert "| random-mask@0 | 25.0 |" in text and "| random-mask@1 | 75.0 |" in text
    assert "| random-mask (mean of 2 draws) | 50.0 |" in text


def test_report_file_and_plots(tmp_path):
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp_path / CONFIG_FILE).write_text(
        json.dumps({"model": "m", "max_new_tokens": 300, "budget_rule": "matched"})
    )
    text = write_report(tmp_path).read_text()
    assert "| full | 75.0 |" in text
    assert "| rlkv | 75.0 |" in text and "| rkv | 25.0 |" in text
    assert "| rlkv | 1 / 0 / 0 of 3 |" in text and "| rkv | 0 / 1 / 1 of 3 |" in text
    assert "| rlkv | 130 / 110 (2) |" in text and "| rkv | 130 / 100 (1) |" in text
    for name in ("accuracy_vs_sparsity.png", "error_modes.png", "common_length.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_a_cell_with_rows_for_only_some_problems_says_how_many(tmp_path):
    """A run in progress: rlkv has rows for 2 of the benchmark's 4 problems, so its pass@1 is over those 2
    and the cell says n=2 (full and rkv, complete, say nothing); so do its paired differences."""
    rows = [r for r in ROWS if not (r["method"] == "rlkv" and r["problem_id"] in ("p3", "p4"))]
    rows.append(_row("p1", "rlkv", 0.75, True, 100))  # rkv has no s=0.75 rows: an empty cell, not nan
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path, plots=False).read_text()
    assert "| rlkv | 100.0 (n=2 of 4) | 100.0 (n=1 of 4) |" in text
    assert "| full | 75.0 | 75.0 |" in text and "| rkv | 25.0 |  |" in text and "nan" not in text
    assert "n=K of N: only K of the benchmark's N problems have rows" in text
    differences = text.split("difference to full")[1].split("##")[0]
    rlkv_line = next(line for line in differences.splitlines() if line.startswith("| rlkv |"))
    assert rlkv_line.count("(n=2)") == 1 and rlkv_line.count("(n=1)") == 1
    rkv_line = next(line for line in differences.splitlines() if line.startswith("| rkv |"))
    assert "(n=" not in rkv_line
    assert "(n=K): paired over only the K problems both methods have rows for yet." in text
    wall = text.split("## Generation wall time (s)")[1]
    assert "| rkv | 2 |  |" in wall  # no rkv rows at s=0.75: empty, not a measured 0 s


def test_report_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no results"):
        write_report(tmp_path)


def _exact_bootstrap_quantiles(d, level=0.95):
    """By hand: every one of the n^n equally likely resamples, the exact distribution of their mean,
    its (1 -/+ level) / 2 quantiles, and how far its CDF is from those levels (the margin a Monte
    Carlo estimate with 10,000 resamples must stay inside: its CDF error is ~0.002)."""
    n = len(d)
    counts = {}
    for draw in itertools.product(d, repeat=n):
        m = Fraction(sum(draw), n)
        counts[m] = counts.get(m, 0) + 1
    cdf, acc = [], 0
    for m in sorted(counts):
        acc += counts[m]
        cdf.append((m, Fraction(acc, n**n)))
    out, margin = [], 1.0
    for q in (
        Fraction(1) - Fraction(level).limit_denominator(),
        Fraction(1) + Fraction(level).limit_denominator(),
    ):
        q /= 2
        out.append(float(next(m for m, c in cdf if c > q)))
        margin = min([margin] + [abs(float(c - q)) for _, c in cdf])
    return out, margin


@pytest.mark.parametrize("d", [[1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 0, -1, 0, 0]])
def test_paired_bootstrap_matches_the_exact_percentiles(d):
    (low, high), margin = _exact_bootstrap_quantiles(d)
    assert margin > 0.01  # the exact CDF is far from 2.5% / 97.5%: the seeded estimate must hit these atoms
    diff, lo, hi = paired_bootstrap(d, resamples=10_000, seed=0)
    assert diff == pytest.approx(sum(d) / len(d))
    assert (lo, hi) == (pytest.approx(low), pytest.approx(high))
    assert paired_bootstrap(d, resamples=10_000, seed=0) == (diff, lo, hi)  # seeded


def test_paired_bootstrap_of_constant_differences_is_a_point():
    assert paired_bootstrap([0.25] * 7) == (0.25, 0.25, 0.25)
    with pytest.raises(ValueError, match="non-empty"):
        paired_bootstrap([])


def test_report_has_paired_intervals_to_full_and_rlkv(tmp_path):
    draws = {"random-mask@0": [True, False, False, False], "random-mask@1": [True, True, True, False]}
    rows = ROWS + [
        _row(f"p{i + 1}", method, 0.5, correct, 100)
        for method, outcomes in draws.items()
        for i, correct in enumerate(outcomes)
    ]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path, plots=False).read_text()
    doc = json.loads((tmp_path / REPORT_JSON).read_text())
    cells = {(c["method"], c["reference"]): c for c in doc["benchmarks"]["b"]["differences"]}
    # per problem p1..p4: full 1110, rlkv 1101, rkv 1000, random-mask draws 1000 / 1110 (mean 1 .5 .5 0)
    expected = {
        ("rlkv", "full"): [0, 0, -1, 1],
        ("rkv", "full"): [0, -1, -1, 0],
        ("rkv", "rlkv"): [0, -1, 0, -1],
        ("random-mask (mean of 2 draws)", "full"): [0, -0.5, -0.5, 0],
        ("random-mask (mean of 2 draws)", "rlkv"): [0, -0.5, 0.5, -1],
    }
    for key, diffs in expected.items():
        diff, low, high = paired_bootstrap(diffs)
        assert (cells[key]["n"], cells[key]["diff"], cells[key]["low"], cells[key]["high"]) == (
            4,
            pytest.approx(diff),
            pytest.approx(low),
            pytest.approx(high),
        ), key
    assert ("full", "rlkv") not in cells and ("rlkv", "rlkv") not in cells
    assert doc["benchmarks"]["b"]["pass_at_1"]["rlkv"] == {"0.5": 0.75}
    low, high = cells[("rkv", "full")]["low"], cells[("rkv", "full")]["high"]
    assert f"| rkv | -50.0 [{100 * low:+.1f}, {100 * high:+.1f}] |" in text
    assert "### b: pass@1 difference to full" in text and "### b: pass@1 difference to rlkv" in text


def test_a_method_that_solves_nothing_leaves_the_others_length_cells():
    """A random mask that solves no problem has no length cell; rlkv's and rkv's stay (they were all empty
    when the table took the samples every method solved)."""
    rows = ROWS + [_row(p, "random-mask@0", 0.5, False, 50, "incorrect") for p in ("p1", "p2", "p3", "p4")]
    lengths = common_length_table(rows)
    assert ("random-mask@0", 0.5) not in lengths and lengths[("rlkv", 0.5)]["n"] == 2


def test_error_modes_and_lengths_are_per_benchmark(tmp_path):
    """Two benchmarks: each gets its own error-mode and length tables, over its own full-solved problems."""
    other = [  # benchmark c: p1 and p2 only, twice as long
        {
            **r,
            "benchmark": "c",
            "key": "c" + r["key"][1:],
            "num_generated_tokens": 2 * r["num_generated_tokens"],
        }
        for r in ROWS
        if r["problem_id"] in ("p1", "p2")
    ]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in ROWS + other))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path, plots=False).read_text()
    b_errors = text.split("## b: error modes")[1].split("##")[0]
    c_errors = text.split("## c: error modes")[1].split("##")[0]
    assert "| rlkv | 1 / 0 / 0 of 3 |" in b_errors and "| rlkv | 0 / 0 / 0 of 2 |" in c_errors
    b_lengths = text.split("## b: generated length")[1].split("##")[0]
    c_lengths = text.split("## c: generated length")[1].split("##")[0]
    assert "| rlkv | 130 / 110 (2) |" in b_lengths and "| rlkv | 260 / 220 (2) |" in c_lengths


def test_each_plot_has_one_panel_per_benchmark(tmp_path):
    """Math and code rows are never pooled into one bar or line: every figure gets a panel per benchmark,
    in the order the rows name them."""
    from rlkv.eval.plots import plot_accuracy, plot_common_length, plot_error_modes

    code = [{**r, "benchmark": "code", "key": "code|" + r["key"]} for r in ROWS]
    rows = ROWS + code
    for plot in (plot_accuracy, plot_error_modes, plot_common_length):
        path = tmp_path / f"{plot.__name__}.png"
        assert plot(rows, path) == ["b", "code"]
        assert path.read_bytes()[:4] == b"\x89PNG"


def test_a_method_has_one_colour_in_every_panel():
    """Benchmark "code" lacks the first method of "b": its lines still take the colours they have in "b"."""
    import matplotlib.pyplot as plt

    from rlkv.eval.plots import accuracy_figure

    first = next(r["method"] for r in ROWS if r["method"] != "full")
    code = [{**r, "benchmark": "code", "key": "code|" + r["key"]} for r in ROWS if r["method"] != first]
    fig, benches = accuracy_figure(ROWS + code)
    try:
        colours = [{line.get_label(): line.get_color() for line in ax.get_lines()} for ax in fig.axes]
    finally:
        plt.close(fig)
    assert benches == ["b", "code"] and first in colours[0] and first not in colours[1]
    shared = set(colours[0]) & set(colours[1]) - {"full"}
    assert shared and all(colours[0][m] == colours[1][m] for m in shared)
    assert len(set(colours[0].values())) == len(colours[0])  # and distinct methods, distinct colours


def test_resident_kv_is_reported_per_benchmark(tmp_path):
    """Benchmark c's sequences are 4x longer: its rlkv cell keeps a smaller share of a full cache (the
    sink + local overhead is fixed), and the two are never pooled into one number."""
    longer = [
        {
            **_row(
                r["problem_id"],
                r["method"],
                r["sparsity"],
                r["correct"],
                r["num_generated_tokens"],
                length=800,
            ),
            "benchmark": "c",
            "key": "c" + r["key"][1:],
        }
        for r in ROWS
    ]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in ROWS + longer))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path, plots=False).read_text()
    b_kv = text.split("## Resident KV on b:")[1].split("##")[0]
    c_kv = text.split("## Resident KV on c:")[1].split("##")[0]
    assert "| rlkv | 70.0 (0.0) |" in b_kv and "| rlkv | 55.0 (0.0) |" in c_kv
    assert "## Resident KV:" not in text


def test_a_grid_of_full_alone_reports_full_in_a_column_of_its_own(tmp_path):
    """`rlkv eval --methods full --sparsities 0.5`: only full's rows (sparsity 0), so no sparsity column;
    every table still has one column, s=0 (full KV), with full's numbers, and no table is left empty."""
    rows = [r for r in ROWS if r["method"] == "full"]
    (tmp_path / RESULTS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / CONFIG_FILE).write_text(json.dumps({"model": "m", "max_new_tokens": 300}))
    text = write_report(tmp_path, plots=False).read_text()
    assert "|  |" not in text and "| method |  |" not in text
    accuracy = text.split("## b: pass@1 (%)")[1].split("##")[0]
    assert "| method | s=0 (full KV) |\n| --- | ---: |\n| full | 75.0 |" in accuracy
    kv = text.split("## Resident KV on b:")[1].split("##")[0]
    assert "| full | 100.0 (0.0) |" in kv
    wall = text.split("## Generation wall time (s)")[1]
    assert "| full | 2 |" in wall
    assert "error modes" not in text  # nothing compressed: no error-mode or length tables to fill
    assert json.loads((tmp_path / REPORT_JSON).read_text())["benchmarks"]["b"]["pass_at_1"] == {
        "full": {"0": 0.75}
    }


@pytest.mark.parametrize(
    ("form", "words"),
    [
        ({}, "sink 16 + the last 64 tokens after a full-attention prompt forward"),
        ({"protect_prompt": True}, "the whole prompt, sink 16 and the last 64 generated tokens"),
        ({"window_prefill": True}, "the prompt forward windowed the same way"),
        (
            {"window_only": True, "sink": 0, "window": 80},
            "a sliding window of the last 0 + 80 tokens, no sink",
        ),
    ],
)
def test_the_report_names_the_form_the_head_mask_methods_ran(form, words):
    """The form line is read from the run's config: a vLLM run in the eval's form is not called window-only."""
    rows = [
        _row(p, m, s, True, 10) | {"engine": "vllm"}
        for p in range(2)
        for m, s in (("full", 0.0), ("rlkv", 0.5))
    ]
    text = render_markdown(rows, {"sink": 16, "window": 64} | form, num_heads=4)
    (line,) = [ln for ln in text.splitlines() if ln.startswith("- head-mask methods' compressed heads keep")]
    assert words in line


def test_a_grid_without_head_mask_methods_names_no_form():
    rows = [_row(p, m, s, True, 10) for p in range(2) for m, s in (("full", 0.0), ("rkv", 0.5))]
    text = render_markdown(rows, {"sink": 16, "window": 64}, num_heads=4)
    assert "compressed heads keep" not in text
