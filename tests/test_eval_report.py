"""report.md tables from a constructed results.jsonl: accuracy, error modes on full-solved problems, common lengths."""

import json

import pytest

from rlkv.eval.report import (
    accuracy_table,
    common_length_table,
    draw_means,
    error_mode_table,
    kv_table,
    write_report,
)
from rlkv.eval.runner import CONFIG_FILE, RESULTS_FILE


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
    common = common_length_table(ROWS)[0.5]
    assert common["n"] == 1  # only p1 is solved by full, rlkv and rkv
    assert common["lengths"] == {"full": 100, "rlkv": 110, "rkv": 130}
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
    assert "| rkv | 130 |" in text and "| (n common) | 1 |" in text
    for name in ("accuracy_vs_sparsity.png", "error_modes.png", "common_length.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_report_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no results"):
        write_report(tmp_path)
