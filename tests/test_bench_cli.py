"""The one benchmark entry: `python -m benchmarks` and `rlkv bench` (which runs it from the checkout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import rlkv.cli.bench
from rlkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
SUITES = ["decode", "memory", "overhead", "train", "real", "serve", "gpu", "gpu_train", "kvpress"]


def test_one_folder_per_suite_and_no_runner_left_in_scripts():
    for suite in SUITES:
        assert (ROOT / "benchmarks" / suite / "__init__.py").is_file(), suite
    assert (ROOT / "benchmarks" / "__main__.py").is_file() and (ROOT / "benchmarks" / "common.py").is_file()
    assert not sorted((ROOT / "scripts").glob("bench*.py"))


def test_rlkv_bench_runs_the_checkouts_benchmarks_from_any_folder(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-m", "rlkv.cli", "bench", "--help"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--suite" in proc.stdout and "gpu-train" in proc.stdout


def test_rlkv_bench_without_a_checkout_is_one_error_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(rlkv.cli.bench, "checkout_root", lambda: tmp_path)
    assert main(["bench", "--suite", "decode"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlkv bench: error:") and "benchmarks/" in err[0]


def test_bench_png_is_written_only_for_the_suites_it_draws(tmp_path):
    """bench.png plots the memory and decode suites; a run of other suites (the vLLM serving part) wrote
    an empty figure before."""
    from benchmarks.__main__ import plots

    assert plots({"vllm": {"rows": []}}, tmp_path) == [] and not list(tmp_path.iterdir())
    assert plots({"memory": {"rows": []}}, tmp_path) == [str(tmp_path / "bench.png")]
