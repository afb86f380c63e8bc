"""The GPU suite (benchmarks/gpu/, `python -m benchmarks --suite gpu`) in its CPU quick mode: every row is
measured or says why not, the fields are sane, the report carries the verdict lines, the time budget
skips rows; the profiler-trace counting on a CUDA-shaped trace; and the serve suite's GPU path (its
defaults, the evictable prompt of a random geometry, the time limit) run on CPU. No timing assertions."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is in the checkout, not in the installed package
sys.path.insert(1, str(ROOT / "scripts"))  # gpu_correctness.py, a device tool

from benchmarks.gpu import profile as bench_gpu_profile  # noqa: E402
from benchmarks.gpu import runner as bench_gpu  # noqa: E402
from benchmarks.serve import probe as bench_serve_probe  # noqa: E402
from benchmarks.serve import report as bench_serve_report  # noqa: E402
from benchmarks.serve import runner as bench_serve  # noqa: E402


def quick_args(*extra: str):
    parser = argparse.ArgumentParser()
    bench_gpu.add_options(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--quick", action="store_true")
    return parser.parse_args(["--quick", *extra])


@pytest.fixture(scope="module")
def quick_run():
    torch.set_num_threads(1)
    return bench_gpu.suite_gpu(quick_args())


def test_quick_suite_measures_every_row_with_sane_fields(quick_run):
    names = [r.name for r in bench_gpu.rows("default", 96)]
    assert [r["name"] for r in quick_run["rows"]] == names  # every row, in order, at the one batch
    measured = {r["name"]: r for r in quick_run["rows"] if "tokens_per_s" in r}
    # every plain and dynamic rlkv row runs on CPU; a static row either runs or says why not
    for name in names:
        if "static" not in name or name.startswith("plain"):
            assert name in measured, (name, next(r for r in quick_run["rows"] if r["name"] == name)["status"])
    for row in quick_run["rows"]:
        if row["name"] not in measured:
            assert row["status"].startswith("not available"), row
    for r in measured.values():
        assert r["steps"] == 24 and r["timed_steps"] >= 1 and r["profiled_steps"] == 3
        assert r["tokens_per_s"] > 0 and r["ms_per_step"] > 0 and r["prefill_s"] > 0
        assert r["resident_kv_bytes"] > 0 and r["roofline_ms"] > 0 and r["of_roofline"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["ms_per_step"])
    # the sparsity shows in the resident KV: streaming heads keep sink + window of 215 tokens
    assert measured["plain eager (SDPA default)"]["kv_vs_full"] == pytest.approx(1.0, abs=0.02)
    assert measured["rlkv s=0 dynamic"]["kv_vs_full"] == pytest.approx(1.0, abs=0.02)
    s05, s075 = measured["rlkv s=0.5 dynamic"]["kv_vs_full"], measured["rlkv s=0.75 dynamic"]["kv_vs_full"]
    assert s075 < s05 < 0.8


def test_report_has_a_verdict_line_per_target(quick_run):
    text = "\n".join(bench_gpu.report_gpu(quick_run))
    for target in bench_gpu.GPU_TARGETS.values():
        assert sum(f": {target}]" in line for line in text.splitlines()) == 1
    assert [v["verdict"] for v in quick_run["verdicts"]][0] == "N/A"  # no CUDA syncs to count on CPU
    assert all(v["verdict"] in ("PASS", "FAIL") for v in quick_run["verdicts"][1:])
    assert quick_run["passed"] is False  # N/A is never a pass
    assert text.count("\n| 2 | ") == len(quick_run["rows"])


def test_time_budget_skips_rows_instead_of_overrunning(tmp_path):
    started = time.perf_counter()
    args = quick_args("--gpu-budget-s", "3", "--gpu-row-s", "2.5")
    args.out = str(tmp_path)
    out = bench_gpu.suite_gpu(args)
    statuses = [r["status"] for r in out["rows"]]
    assert any(s.startswith("skipped (time budget") for s in statuses)
    first_skip = next(i for i, s in enumerate(statuses) if s.startswith("skipped"))
    assert all(s.startswith("skipped") for s in statuses[first_skip:])  # once out of time, every later row
    assert time.perf_counter() - started < 3 + 30  # the build, and one row at most past its 2.5 s
    assert "skipped (time budget" in "\n".join(bench_gpu.report_gpu(out))
    # every finished row is on disk at once: a run killed by the device's time limit keeps them
    assert json.loads((tmp_path / "bench_gpu_rows.json").read_text()) == json.loads(json.dumps(out["rows"]))


def test_step_clock_stops_every_row_at_the_deadline():
    clock = bench_gpu.StepClock(
        3, "cpu", warm=1, profile_steps=1, row_s=60.0, hard_end=time.perf_counter() - 1
    )
    ids = torch.zeros(3, 5, dtype=torch.long)
    assert clock(ids, None).all()  # past the suite's hard end: stop now
    clock = bench_gpu.StepClock(
        3, "cpu", warm=1, profile_steps=1, row_s=60.0, hard_end=time.perf_counter() + 60
    )
    assert not any(clock(ids, None).any() for _ in range(4))
    assert len(clock.stamps) == 4 and not clock.profiling


def _event(cat: str, name: str, ts: float, dur: float = 1.0) -> dict:
    return dict(ph="X", cat=cat, name=name, ts=ts, dur=dur)


def test_step_counts_read_launches_syncs_and_busy_time_from_a_cuda_trace():
    events = []
    for step in range(3):  # steps of 100 us: mark, loop sync, forward mark, 5 launches + 1 forward sync
        t = step * 100.0
        events.append(_event("user_annotation", bench_gpu_profile.STEP_MARK, t))
        events.append(_event("cuda_runtime", "cudaStreamSynchronize", t + 5))
        events.append(_event("user_annotation", bench_gpu_profile.FORWARD_MARK, t + 10))
        events += [_event("cuda_runtime", "cudaLaunchKernel", t + 20 + i) for i in range(4)]
        events.append(_event("cuda_driver", "cuLaunchKernelEx_v11060", t + 30))  # CUPTI's versioned name
        events.append(_event("cuda_runtime", "cudaMemcpyAsync", t + 40))  # not a sync by itself
        events.append(_event("cuda_runtime", "cudaStreamSynchronize", t + 41))
        events.append(_event("kernel", "gemm", t + 20, 30))
        events.append(_event("kernel", "gemm2", t + 40, 20))  # overlaps the first by 10 us
    events.append(_event("user_annotation", bench_gpu_profile.STEP_MARK, 300.0))
    events.append(_event("cuda_runtime", "cudaGraphLaunch", 350.0))  # after the last mark: not counted
    counts = bench_gpu_profile.step_counts(events, "cuda")
    assert counts["profiled_steps"] == 3
    assert counts["kernel_launches"] == 5 and counts["graph_launches"] == 0
    assert counts["host_syncs"] == 2 and counts["loop_syncs"] == 1 and counts["forward_syncs"] == 1
    assert counts["gpu_busy"] == pytest.approx(0.4)  # 40 us of each 100 us step
    compiled = [e for e in events if e["name"] != bench_gpu_profile.FORWARD_MARK]
    counts = bench_gpu_profile.step_counts(compiled, "cuda")
    assert counts["forward_syncs"] is None and counts["host_syncs"] == 2
    assert bench_gpu_profile.step_counts(events, "cpu")["kernel_launches"] is None


def test_verdicts_take_generates_loop_syncs_out_of_a_compiled_row():
    base = dict(
        batch=16, policy="streaming", tokens_per_s=100.0, of_roofline=0.6, ms_per_step=10, roofline_ms=6
    )
    summary = dict(
        batches=[16],
        rows=[
            dict(base, name="rlkv s=0.5 dynamic", forward_syncs=0.0, loop_syncs=1.0, host_syncs=1.0),
            dict(base, name="rlkv s=0.5 static", forward_syncs=None, loop_syncs=None, host_syncs=1.0),
            dict(base, name="plain eager (SDPA flash)", policy=None, tokens_per_s=80.0),
            dict(base, name="plain StaticCache + compile", policy=None, tokens_per_s=120.0),
        ],
    )
    v = {x["name"]: x["verdict"] for x in bench_gpu.verdicts(summary)}
    assert v == dict(syncs="PASS", vs_flash="PASS", vs_compile="FAIL", roofline="PASS")
    summary["rows"][1]["host_syncs"] = 3.0  # two syncs beyond generate's own: the forward syncs
    assert bench_gpu.verdicts(summary)[0]["verdict"] == "FAIL"


# ------------------------------------------------------------- the serve suite's GPU path, run on CPU
def serve_args(**overrides) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_options(parser)
    args = parser.parse_args([])
    args.model, args.quick, args.device, args.dtype, args.out = None, False, "cpu", "auto", None
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def test_serve_on_cuda_defaults_to_the_7b_geometry_with_a_cap_of_16_full_rows_of_4k():
    args = serve_args(device="cuda", dtype="bfloat16")  # auto is bf16 on a GPU; this machine has none
    bench_serve.resolve_serve_args(args)
    assert args.serve_model_spec == "qwen2.5-7b" and not bench_serve.protect_prompt(args.serve_model_spec)
    assert (args.prompt_tokens, args.serve_tokens, args.serve_time_limit) == (3584, 512, 420.0)
    per_token = 2 * 28 * 4 * 128 * 2  # K and V, 28 layers x 4 KV heads x head_dim 128, bf16
    assert args.cap_bytes == 16 * 4096 * per_token  # 3.5 GiB
    cpu = serve_args()
    bench_serve.resolve_serve_args(cpu)  # the CPU defaults are unchanged
    assert (cpu.serve_model_spec, cpu.prompt_tokens, cpu.serve_tokens) == ("synthetic", 64, 4096)
    assert bench_serve.protect_prompt(cpu.serve_model_spec) and cpu.serve_time_limit == float("inf")
    assert bench_serve.serve_targets("cuda")["rlkv s=0.5"][0] == 1.8  # RLKV's SGLang runtime: 1.80x


@pytest.fixture(scope="module")
def tiny_geometry():
    torch.manual_seed(0)
    model = bench_gpu_profile.build_random_model("tiny", "cpu", torch.float32)
    return model, torch.randint(1, model.config.vocab_size, (1, 96))


def test_serve_probe_on_a_random_geometry_evicts_the_prompt(tiny_geometry):
    model, prompt = tiny_geometry
    methods = {m.name: m for m in bench_serve_probe.methods(96, [])}
    kv = {}
    for name in ("full", "rlkv s=0.5"):
        for protect in (True, False):
            r = bench_serve_probe.serve_probe(
                model, prompt, methods[name], 2, 16, 2**40, protect_prompt=protect
            )
            assert r["fits"] and not r["timed_out"] and r["generated"] == 16
            kv[name, protect] = r["peak_kv_bytes"]
    # 96 + 16 tokens, streaming keeps sink + window = 80 of them: only an evictable prompt saves
    assert kv["full", True] == kv["full", False]
    assert kv["rlkv s=0.5", False] < 0.9 * kv["rlkv s=0.5", True]


def test_serve_probe_stops_at_the_deadline_without_claiming_over_the_cap(tiny_geometry):
    model, prompt = tiny_geometry
    full = bench_serve_probe.methods(96, [])[0]
    r = bench_serve_probe.serve_probe(model, prompt, full, 2, 16, 2**40, deadline=time.perf_counter())
    assert r["timed_out"] and not r["fits"] and r["generated"] == 1


def test_serve_time_limit_skips_the_remaining_methods():
    args = serve_args(
        quick=True, serve_model="tiny:llama", serve_tokens=24, serve_time_limit=0.0, max_batch=4
    )
    s = bench_serve.suite_serve(args)
    assert [r["status"] for r in s["rows"]] == ["skipped (time limit)"] * 5
    assert s["passed"] is False and not any(s["verdicts"].values())
    text = "\n".join(bench_serve_report.report_serve(s))
    assert text.count("skipped (time limit)") == 5


# --------------------------------------------------------------- gpu_correctness.py and gpu_check.sh
def test_correctness_report_on_cpu_counts_every_policy_and_s0_matches_plain_generate(tmp_path):
    import gpu_correctness

    from rlkv.policies import available

    out = tmp_path / "correctness.md"
    assert gpu_correctness.main(["--device", "cpu", "--quick", "--out", str(out)]) == 0
    text = out.read_text()
    counted = gpu_correctness.SyncCounter("cpu").available
    for name in available():
        line = next(x for x in text.splitlines() if x.startswith(f"| {name} | "))
        cells = [c.strip() for c in line.strip("|").split("|")[1:]]
        assert all((" / " in c) if counted else c == "not counted" for c in cells), line
    assert "| plain generate vs rlkv s=0.0 dynamic | 4 of 4 |" in text  # sparsity 0 = plain generate
    assert "rlkv s=0.5 dynamic vs rlkv s=0.5 static" in text
    assert sum(x.startswith(("[PASS:", "[FAIL:", "[N/A:")) for x in text.splitlines()) == 1


def test_sync_counter_counts_a_host_read_on_cpu():
    import gpu_correctness

    counter = gpu_correctness.SyncCounter("cpu")
    if not counter.available:
        pytest.skip("rlkv.testing.HostSyncCounter is not there yet")
    t = torch.arange(4.0)
    with counter.counting() as none:
        (t * 2).sum()
    with counter.counting() as one:
        t.sum().item()
    assert (none[0], one[0]) == (0, 1)


def test_gpu_check_script_runs_to_the_end_and_skips_what_does_not_fit(tmp_path):
    env = dict(
        os.environ, GPU_CHECK_DEVICE="cpu", PYTHON=sys.executable, OUT=str(tmp_path), GPU_CHECK_SECONDS="0"
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / "gpu_check.log").read_text()
    for step in ("correctness", "gpu", "serve"):
        assert f"{step}: skipped" in log
    assert "torch" in log and "done in" in log
    assert [p.name for p in tmp_path.iterdir()] == ["gpu_check.log"]  # at most 8 files come back


def test_a_search_cut_by_the_time_limit_keeps_its_finished_probes():
    probes = [
        dict(batch=16, fits=True, decode_tokens_per_s=10.0, peak_kv_bytes=4),
        dict(batch=24, fits=False, peak_kv_bytes=6),
        dict(batch=20, fits=True, decode_tokens_per_s=12.0, peak_kv_bytes=5),
    ]
    full = bench_serve_probe.methods(96, [])[0]
    row = bench_serve.method_row(full, bench_serve.partial_search(probes), cut=True)
    assert (row["max_batch"], row["first_over_batch"], row["decode_tokens_per_s"]) == (20, 24, 12.0)
    assert row["status"] == "search cut by the time limit" and len(row["probes"]) == 3
    assert bench_serve.partial_search([]) is None
    assert bench_serve.method_row(full, None)["status"] == "skipped (time limit)"
