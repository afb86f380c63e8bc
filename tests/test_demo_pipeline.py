"""`make demo`'s pipeline (scripts/demo.py) end to end on the shipped demo model, in its smoke setting."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlkv.eval.runner import read_results
from rlkv.head_mask import HeadMask

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"full", "rlkv", "rlkv+rkv", "ablation-mask", "random-mask@0", "random-mask@1", "rkv", "streaming"}


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_smoke_demo_runs_every_stage_and_prints_the_table(smoke_run):
    out, stdout = smoke_run
    stats = json.loads((out / "curriculum" / "stats.json").read_text())
    assert stats["selected"] > 0 and stats["pool_accuracy"] >= 0.9  # the demo model solves the task
    assert "| method |" in stdout and "timings: curriculum" in stdout
    report = (out / "eval" / "report.md").read_text()
    for method in [*METHODS, "random-mask (mean of 2 draws)"]:
        assert f"| {method} |" in report


def test_smoke_demo_mask_fits_the_demo_model_and_eval_used_it(smoke_run):
    from transformers import AutoConfig

    out, _ = smoke_run
    mask = HeadMask.load(out / "head_mask.json")
    config = AutoConfig.from_pretrained(ROOT / "assets" / "demo-model")
    mask.check_compatible(config)
    assert mask.metadata["objective"] == "distill"  # the demo's default objective (issue 48)
    HeadMask.from_pretrained(out / "ablation-mask", config)  # the baseline the eval compares against
    rows = read_results(out / "eval" / "results.jsonl")
    assert {r["method"] for r in rows} == METHODS
    assert len({(r["method"], r["problem_id"]) for r in rows}) == len(rows)  # one row per method x problem
    full = [r for r in rows if r["method"] == "full"]
    assert full and all(r["correct"] for r in full)  # the shipped model solves held-out problems
