"""The vLLM suite's --vllm-methods cells (METHOD or METHOD@S), parsed without vLLM installed."""

from __future__ import annotations

import pytest

from benchmarks.vllm.runner import method_cells


def test_a_method_runs_at_both_sparsities_and_at_one_with_an_at_sign():
    assert method_cells("rlkv+rkv,rkv") == [
        ("rlkv+rkv", 0.5),
        ("rlkv+rkv", 0.75),
        ("rkv", 0.5),
        ("rkv", 0.75),
    ]
    assert method_cells("rlkv+rkv@0.75,rkv@0.5") == [("rlkv+rkv", 0.75), ("rkv", 0.5)]
    assert method_cells("rkv,rkv@0.5") == [("rkv", 0.5), ("rkv", 0.75)]  # a cell runs once


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("h2o", "choose rlkv, rlkv+rkv and/or rkv"),
        ("rkv@half", "is a number"),
        ("rkv@1.5", "between 0 and 1"),
    ],
)
def test_a_bad_cell_is_one_error_naming_the_option(spec, says):
    with pytest.raises(SystemExit, match="--vllm-methods") as err:
        method_cells(spec)
    assert says in str(err.value)


def test_the_dispatch_part_checks_each_capped_cell_against_stock_and_the_spread_of_rlkv():
    from benchmarks.vllm.dispatch import _compressed_parts, dispatch_checks, report_dispatch

    def row(method, sparsity, ops, buffer=None):
        return {"model": "m", "batch": 8, "method": method, "sparsity": sparsity, "buffer": buffer}, ops

    cells = [
        row("stock", 0.0, 100),
        row("rlkv", 0.25, 110),
        row("rlkv", 0.5, 120),
        row("rlkv", 0.75, 140),
        row("rlkv+rkv", 0.75, 125, 128),
        row("rkv", 0.5, 131, 128),
        row("rkv", 0.5, 400, 0),  # the eval's matched config: reported, not capped
    ]
    rows = [
        r | {"ops_per_step": ops, "min": ops, "max": ops, "compressed_parts_per_layer": 1} for r, ops in cells
    ]
    for r in rows:  # views counted apart: half of each count here
        r["non_view_ops_per_step"] = r["ops_per_step"] / 2
    checks = {c["what"]: (round(c["value"], 2), c["pass"]) for c in dispatch_checks(rows)}
    assert checks == {
        "rlkv s=0.5": (1.2, True),
        "rlkv s=0.75": (1.4, False),
        "rlkv+rkv s=0.75 buffer 128": (1.25, True),
        "rkv s=0.5 buffer 128": (1.31, False),
        "rlkv s=0.25 / 0.5 / 0.75 spread": (0.27, False),
    }
    assert "| m | 8 | rkv | 0.5 | 0 | 1 | 400 | 400 | 400 | 4.00x | 200 | 4.00x |" in report_dispatch(
        {"rows": rows, "checks": []}
    )
    # an uneven mask: layers of 1 and 3 full of 4 KV heads -> parts of one head, up to 3 compressed per layer
    assert _compressed_parts({"rlkv_head_split": {"full_kv_heads": [[0], [0, 1, 2]]}}, 4) == 3
    assert _compressed_parts({"rlkv_head_split": {"full_kv_heads": [[0, 1], [2, 3]]}}, 4) == 1
    assert _compressed_parts(None, 4) is None
