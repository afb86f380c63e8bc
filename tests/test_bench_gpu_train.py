"""`python -m benchmarks --suite gpu-train` (benchmarks/gpu_train/): its CPU quick run measures every
part of a real GRPO step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is in the checkout, not in the installed package

from benchmarks.gpu_train import report as bench_gpu_train_report  # noqa: E402
from benchmarks.gpu_train import runner as bench_gpu_train  # noqa: E402
from benchmarks.gpu_train.parts import PartTimer, count_host_syncs  # noqa: E402


def _quick(out: Path, *flags: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--suite", "gpu-train", "--quick", "--out", str(out), *flags],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "bench.json").read_text())["gpu-train"], (out / "bench.md").read_text()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return _quick(tmp_path_factory.mktemp("gpu-train"))


def test_quick_run_times_every_part_of_one_real_grpo_step(quick_run):
    r, _ = quick_run
    rows = r["prompts"] * r["generations"]
    for rollout in (r["gated"]["rollout"], r["plain"]["rollout"], r["compressed"]["rollout"]):
        assert rollout["tokens"] == rows * r["tokens"]  # EOS suppressed: every completion is full length
        assert rollout["seconds"] > 0
    for step in (r["gated"], r["compressed"]):
        assert step["step_seconds"] > step["rollout_seconds"] > 0
        assert step["loss_forward_seconds"] > 0 and step["backward_seconds"] > 0
    # an on-policy gate step makes no no-grad log-prob pass; the importance-sampling step makes one
    assert r["gated"]["logps_passes"] == 0 and r["compressed"]["logps_passes"] == 1
    assert r["gated"]["logps_pass_seconds"] > 0
    baseline = r["plain"]["rollout"]["seconds"] + r["gated"]["logps_pass_seconds"]
    baseline += r["gated"]["loss_forward_seconds"] + r["gated"]["backward_seconds"]
    assert r["step_baseline_seconds"] == pytest.approx(baseline)


def test_quick_run_reports_compressed_rollout_memory_and_importance_ratio(quick_run):
    r, _ = quick_run
    c = r["compressed"]
    assert 0 < c["resident_kv_bytes"] < c["full_kv_bytes"]  # the streaming heads evicted tokens
    ratio = c["importance_sampling_ratio"]
    assert ratio["min"] <= ratio["mean"] <= ratio["max"] and ratio["min"] > 0


def test_quick_run_counts_decode_host_syncs_and_prints_every_target(quick_run):
    r, text = quick_run
    for probe in (r["gated"]["probe"], r["plain"]["probe"], r["compressed"]["probe"]):
        assert probe["seconds_per_step"] > 0 and probe["host_syncs_per_step"] >= 0
        assert probe["kernel_launches_per_step"] is None  # CUDA only
    for loop in (r["gated"]["rollout_loop"], r["compressed"]["rollout_loop"]):  # generate's own work too
        assert loop["host_syncs_per_step"] == 0 and loop["kernel_launches_per_step"] is None
    assert "| gated rollout loop (generate) |" in text
    assert r["targets"]["memory"] is None and r["gated"]["step_peak_bytes"] is None  # no allocator on CPU
    for target in bench_gpu_train_report.TARGETS.values():
        assert target in text
    assert r["passed"] == all(v for v in r["targets"].values() if v is not None)


def test_count_host_syncs_on_cpu_sees_item_and_nonzero():
    x = torch.arange(6.0)
    assert count_host_syncs(lambda: (x + 1).sum(), torch.device("cpu")) == 0
    assert count_host_syncs(lambda: (x.sum().item(), x.nonzero()), torch.device("cpu")) == 2


def test_part_timer_nests_parts_and_has_no_allocator_peak_on_cpu():
    timer = PartTimer(torch.device("cpu"))
    with timer.part("outer"):
        with timer.part("inner"):
            torch.ones(64, 64).matmul(torch.ones(64, 64))
    assert timer.seconds("outer") >= timer.seconds("inner") > 0
    assert timer.peak("outer") is None and timer.seconds("missing") == 0


def test_plan_tokens_lowers_the_completion_length_to_fit_the_budget():
    probe = {"seconds_per_step": 0.05, "prefill_seconds": 0.5}
    assert bench_gpu_train.plan_tokens(1024, 10_000, probe, prompt_tokens=256) == 1024  # never raised
    fitted = bench_gpu_train.plan_tokens(1024, 120, probe, prompt_tokens=256)
    assert 64 <= fitted < 1024 and fitted % 64 == 0
    assert bench_gpu_train.plan_tokens(1024, 1, probe, prompt_tokens=256) == 1


def test_full_geometry_on_cpu_is_refused_with_the_way_out(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--suite", "gpu-train", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0 and "--quick" in proc.stderr and "--device cuda" in proc.stderr


def test_micro_batches_split_the_loss_not_the_rollout():
    import argparse

    parser = argparse.ArgumentParser()
    bench_gpu_train.add_options(parser)
    args = parser.parse_args(["--train-micro-batch", "16"])
    settings = bench_gpu_train.grpo_settings(args, torch.device("cpu"), 1024, "out")
    assert settings["per_device_train_batch_size"] == 16 and settings["gradient_accumulation_steps"] == 4
    assert settings["generation_kwargs"]["min_new_tokens"] == 1024  # every completion full length
    whole = bench_gpu_train.grpo_settings(parser.parse_args([]), torch.device("cpu"), 8, "out")
    assert whole["per_device_train_batch_size"] == 64 and whole["gradient_accumulation_steps"] == 1
    with pytest.raises(SystemExit, match="must divide the 64 completions"):
        bench_gpu_train.grpo_settings(
            parser.parse_args(["--train-micro-batch", "24"]), torch.device("cpu"), 8, "o"
        )


def test_a_spent_budget_shortens_the_rollouts_and_skips_the_compressed_step(tmp_path):
    r, text = _quick(tmp_path, "--train-budget-s", "0.001")  # spent by the decode probe on any machine
    assert r["tokens"] == 1 < r["tokens_requested"]  # lowered by the budget, and said so
    assert "lowered to fit --train-budget-s" in text
    assert r["compressed"]["skipped"].startswith("skipped:") and "| GRPO step s |" in text
    assert r["gated"]["rollout"]["tokens"] == r["prompts"] * r["generations"]  # the gated step still ran


def test_quick_run_on_a_static_rollout_cache(tmp_path):
    """`--train-rollout-cache static`: the gated and plain rollouts decode on transformers' StaticCache
    (TRL's `cache_implementation`), the compressed ones on rlkv's static cache, with no host sync per
    step of the gated and compressed rollout loops."""
    r, _ = _quick(tmp_path, "--train-rollout-cache", "static")
    assert r["gated"]["rollout_loop"]["host_syncs_per_step"] == 0
    assert r["compressed"]["rollout_loop"]["host_syncs_per_step"] == 0
    assert r["compressed"]["rollout_cache"] == "static"
    assert r["gated"]["rollout"]["tokens_per_second"] > 0 and r["plain"]["rollout"]["tokens_per_second"] > 0
