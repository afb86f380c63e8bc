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
