"""`rlkv compare`: two eval cells paired by (benchmark, problem id), across folders."""

import json
from pathlib import Path

import pytest

from rlkv.errors import UserInputError
from rlkv.eval.compare import Cell, compare_cells, format_comparison, parse_cell
from rlkv.eval.tables import paired_bootstrap


def _write(folder, rows, hosts=("host A",)):
    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for bench, pid, method, sparsity, sample, correct in rows:
        key = f"{bench}|{pid}|{method}|{sparsity}|{sample}"
        lines.append(
            json.dumps(
                {
                    "key": key,
                    "benchmark": bench,
                    "problem_id": pid,
                    "method": method,
                    "sparsity": sparsity,
                    "sample": sample,
                    "correct": correct,
                }
            )
        )
    (folder / "results.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "eval_config.json").write_text(json.dumps({"hosts": list(hosts)}))


def test_pairs_two_folders_by_problem_and_averages_samples(tmp_path):
    new, grid = tmp_path / "new", tmp_path / "grid"
    _write(
        new,
        [("math", f"p{i}", "rlkv", 0.75, 0, i % 2 == 0) for i in range(6)]
        + [
            ("code", "c0", "rlkv", 0.75, 0, True),
            ("code", "c0", "rlkv", 0.75, 1, False),  # two samples: 0.5
            ("math", "extra", "rlkv", 0.75, 0, True),  # not in the grid: not paired
        ],
    )
    _write(
        grid,
        [("math", f"p{i}", "ablation-mask", 0.75, 0, i < 2) for i in range(6)]
        + [
            ("code", "c0", "ablation-mask", 0.75, 0, False),
            ("math", "p0", "ablation-mask", 0.5, 0, False),  # another sparsity: not this cell
        ],
    )
    table = compare_cells(parse_cell(f"{new}:rlkv@0.75"), parse_cell(f"{grid}:ablation-mask@0.75"))
    by = {row["benchmark"]: row for row in table}
    assert [r["benchmark"] for r in table] == ["code", "math", "all"]
    assert (by["math"]["n"], by["math"]["a_solved"], by["math"]["b_solved"]) == (6, 3, 2)
    math_diffs = [float(i % 2 == 0) - float(i < 2) for i in range(6)]
    assert (by["math"]["diff"], by["math"]["low"], by["math"]["high"]) == paired_bootstrap(math_diffs)
    assert (by["code"]["n"], by["code"]["a"], by["code"]["b"]) == (1, 0.5, 0.0)
    assert by["all"]["n"] == 7 and by["all"]["diff"] == pytest.approx((sum(math_diffs) + 0.5) / 7)
    text = format_comparison(Cell(new, "rlkv", 0.75), Cell(grid, "ablation-mask", 0.75), table)
    assert "| math | 6 | 3 | 2 | 50.0% | 33.3% |" in text and "warning" not in text


def test_errors_name_the_fix_and_different_hosts_warn(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    _write(a, [("math", "p0", "rlkv", 0.5, 0, True), ("math", "p0", "rlkv", 0.75, 0, True)])
    _write(b, [("math", "p0", "full", 0.0, 0, True)], hosts=("host B",))
    with pytest.raises(UserInputError, match="FOLDER:METHOD"):
        parse_cell("no-colon")
    assert parse_cell("run:random-mask@1@0.75") == Cell(Path("run"), "random-mask@1", 0.75)  # a seeded draw
    assert parse_cell("run:ablation-mask@0.75") == Cell(Path("run"), "ablation-mask", 0.75)
    with pytest.raises(UserInputError, match="@0.75"):
        parse_cell(f"{a}:rlkv@x")
    with pytest.raises(UserInputError, match="name one as METHOD@SPARSITY"):
        compare_cells(parse_cell(f"{a}:rlkv"), parse_cell(f"{b}:full"))
    with pytest.raises(UserInputError, match="no rows.*full"):
        compare_cells(parse_cell(f"{b}:rlkv@0.5"), parse_cell(f"{b}:full"))
    with pytest.raises(UserInputError, match="results.jsonl"):
        compare_cells(parse_cell(f"{tmp_path / 'none'}:rlkv"), parse_cell(f"{b}:full"))
    cells = parse_cell(f"{a}:rlkv@0.5"), parse_cell(f"{b}:full")
    assert "hosts differ" in format_comparison(*cells, compare_cells(*cells))


def test_cli_prints_the_table(tmp_path, capsys):
    from rlkv.cli import main

    a = tmp_path / "a"
    _write(
        a,
        [
            ("math", f"p{i}", m, s, 0, i < k)
            for i in range(4)
            for m, s, k in (("rlkv", 0.5, 3), ("full", 0.0, 4))
        ],
    )
    assert main(["compare", f"{a}:rlkv@0.5", f"{a}:full", "--resamples", "200"]) == 0
    assert "| math | 4 | 3 | 4 | 75.0% | 100.0% | -25.0 [" in capsys.readouterr().out
    assert main(["compare", f"{a}:rlkv", "broken"]) == 2
    assert "FOLDER:METHOD" in capsys.readouterr().err
