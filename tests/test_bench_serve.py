"""The serve benchmark (benchmarks/serve/: runner.py, probe.py, report.py): the max-batch
search and the report, not speed."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # benchmarks/ is in the checkout, not in the installed package

from benchmarks.serve import probe as bench_serve_probe  # noqa: E402
from benchmarks.serve import report as bench_serve_report  # noqa: E402
from benchmarks.serve import runner as bench_serve  # noqa: E402
from rlkv.testing import tiny_model  # noqa: E402

NEW_TOKENS = 24


def fake_probe(per_row: int, cap: int, calls: list[int]):
    def probe(batch: int) -> dict:
        calls.append(batch)
        return dict(batch=batch, fits=batch * per_row <= cap, peak_kv_bytes=batch * per_row)

    return probe


@pytest.mark.parametrize("max_fit", [1, 2, 3, 5, 8, 13])
def test_search_finds_the_batch_that_fits_and_the_one_over(max_fit):
    calls: list[int] = []
    out = bench_serve_probe.find_max_batch(fake_probe(100, max_fit * 100 + 50, calls))
    assert (out["fit"], out["over"]) == (max_fit, max_fit + 1)
    assert out["fit_result"]["fits"] and not out["over_result"]["fits"]
    assert {p["batch"] for p in out["probes"]} == set(calls) and len(calls) == len(set(calls))
    assert len(calls) <= 2 * max_fit.bit_length() + 2  # no cap: galloping from 2, then bisection


@pytest.mark.parametrize("max_fit", [1, 2, 3, 7, 20])
def test_search_from_a_right_guess_costs_two_probes(max_fit):
    calls: list[int] = []
    out = bench_serve_probe.find_max_batch(fake_probe(100, max_fit * 100 + 50, calls), guess=max_fit)
    assert (out["fit"], out["over"]) == (max_fit, max_fit + 1)
    assert calls == [max_fit, max_fit + 1]


@pytest.mark.parametrize("guess", [1, 2, 5, 9, 10, 11, 30, 500])
def test_search_is_exact_whatever_the_guess(guess):
    calls: list[int] = []
    out = bench_serve_probe.find_max_batch(fake_probe(100, 1050, calls), guess=guess)
    assert (out["fit"], out["over"]) == (10, 11)
    assert out["fit_result"]["batch"] == 10 and out["over_result"]["batch"] == 11
    assert len(calls) == len(set(calls)) and len(calls) <= 2 * guess.bit_length() + 8


def test_search_when_nothing_fits_and_when_the_limit_fits():
    for guess in (1, 4):
        none = bench_serve_probe.find_max_batch(fake_probe(100, 50, []), guess=guess)
        assert (none["fit"], none["over"], none["fit_result"]) == (0, 1, None)
        capped = bench_serve_probe.find_max_batch(fake_probe(1, 10**9, []), max_batch=6, guess=guess)
        assert (capped["fit"], capped["over"], capped["over_result"]) == (6, None, None)
    single = bench_serve_probe.find_max_batch(fake_probe(1, 10**9, []), max_batch=1, guess=3)
    assert (single["fit"], single["over"], len(single["probes"])) == (1, None, 1)


@pytest.fixture(scope="module")
def model_and_prompt():
    torch.manual_seed(0)
    model = tiny_model("llama")
    prompt = torch.randint(1, model.config.vocab_size, (1, 8))
    return model, prompt


def peak_kv(model, prompt, method, batch) -> int:
    r = bench_serve_probe.serve_probe(model, prompt, method, batch, NEW_TOKENS, cap_bytes=2**40)
    assert r["fits"] and r["generated"] == NEW_TOKENS
    return r["peak_kv_bytes"]


@pytest.mark.parametrize("name", ["full", "rlkv s=0.5"])
def test_real_runs_against_a_hand_built_cap(model_and_prompt, name):
    """A cap between the peak KV of batch 3 and batch 4: the search must report 3 fits, 4 does not."""
    model, prompt = model_and_prompt
    method = next(m for m in bench_serve_probe.methods(96, []) if m.name == name)
    three, four = peak_kv(model, prompt, method, 3), peak_kv(model, prompt, method, 4)
    assert three < four
    cap = (three + four) // 2

    def probe(b):
        return bench_serve_probe.serve_probe(model, prompt, method, b, NEW_TOKENS, cap)

    out = bench_serve_probe.find_max_batch(probe)
    assert (out["fit"], out["over"]) == (3, 4)
    fit, over = out["fit_result"], out["over_result"]
    assert fit["fits"] and fit["generated"] == NEW_TOKENS and fit["peak_kv_bytes"] <= cap
    assert not over["fits"] and over["peak_kv_bytes"] > cap and over["generated"] < NEW_TOKENS + 1
    assert fit["whole_tokens_per_s"] > 0 and fit["decode_tokens_per_s"] > 0 and fit["peak_rss_bytes"] > 0


@pytest.mark.parametrize("name", ["full", "rlkv s=0.5", "rkv b=96"])
def test_the_search_guess_is_near_one_rows_measured_kv(model_and_prompt, name):
    model, prompt = model_and_prompt
    method = next(m for m in bench_serve_probe.methods(96, []) if m.name == name)
    args = argparse.Namespace(
        serve_model_spec="tiny:llama", serve_layers=2, dtype="float32", device="cpu",
        prompt_tokens=prompt.shape[1], serve_tokens=NEW_TOKENS, serve_budget=96,
    )  # fmt: skip
    estimate = bench_serve_probe.row_kv_estimate(args, method, bench_serve_probe.kv_geometry(args))
    assert 0.8 < estimate / peak_kv(model, prompt, method, 1) < 1.25


def test_full_kv_is_the_dynamic_cache_storage(model_and_prompt):
    model, prompt = model_and_prompt
    cfg = model.config
    full = bench_serve_probe.methods(96, [])[0]
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4  # K+V, fp32
    assert peak_kv(model, prompt, full, 2) == 2 * per_token * (prompt.shape[1] + NEW_TOKENS - 1)


def test_report_fields_and_verdicts(model_and_prompt, tmp_path):
    args = argparse.Namespace(
        quick=True,
        serve_model="tiny:llama",
        model=None,
        serve_policies="",
        serve_tokens=NEW_TOKENS,
        prompt_tokens=8,
        serve_budget=96,
        kv_cap_gib=None,
        serve_layers=1,
        device="cpu",
        dtype="auto",
        mask=None,
        max_batch=8,
    )
    s = bench_serve.suite_serve(args)
    names = [r["method"] for r in s["rows"]]
    assert names == ["full", "rlkv s=0.5", "rlkv s=0.75", "rkv b=96", "rlkv+rkv s=0.5"]
    for r in s["rows"]:
        for key in (
            "max_batch",
            "first_over_batch",
            "decode_tokens_per_s",
            "whole_tokens_per_s",
            "peak_kv_bytes",
            "over_peak_kv_bytes",
            "peak_rss_bytes",
            "decode_vs_full",
            "whole_vs_full",
            "max_batch_vs_full",
            "probes",
        ):
            assert key in r
        assert r["max_batch"] >= 1 and r["first_over_batch"] == r["max_batch"] + 1
        assert r["peak_kv_bytes"] <= s["cap_bytes"] < r["over_peak_kv_bytes"]
    assert set(s["verdicts"]) == {"rlkv s=0.5", "rkv b=96"}
    assert s["passed"] == all(s["verdicts"].values())
    text = "\n".join(bench_serve_report.report_serve(s))
    assert "| full | " in text and ("PASS" in text or "FAIL" in text)
    json.dumps(s)  # the suite's result is written as JSON
    assert Path(bench_serve_report.plot_serve(s, tmp_path / "serve.png")).stat().st_size > 0


def test_worker_process_prints_one_probe(tmp_path):
    cmd = [sys.executable, "-m", "benchmarks.serve.runner", "--worker", "serve", "--method", "rlkv s=0.5"]
    cmd += ["--batch", "2", "--cap-bytes", str(2**30), "--serve-model-spec", "tiny:llama"]
    cmd += ["--serve-tokens", "6", "--prompt-tokens", "4", "--serve-budget", "96", "--threads", "1"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["method"], r["batch"], r["fits"], r["generated"]) == ("rlkv s=0.5", 2, True, 6)


def test_recorded_probes_are_reused_by_a_rerun_under_the_same_settings_only(tmp_path):
    path = tmp_path / "serve_probes.jsonl"
    key = dict(method="full", cap_bytes=1050, serve_tokens=24)
    calls: list[int] = []
    first = bench_serve_probe.find_max_batch(
        bench_serve_probe.recorded_probe(fake_probe(100, 1050, calls), path, key), guess=4
    )
    ran = list(calls)
    with path.open("a") as f:
        f.write('{"key": {"method": "full"')  # a line cut off by a kill
    again: list[int] = []
    rerun = bench_serve_probe.find_max_batch(
        bench_serve_probe.recorded_probe(fake_probe(100, 1050, again), path, key), guess=4
    )
    assert again == [] and (rerun["fit"], rerun["over"]) == (first["fit"], first["over"]) == (10, 11)
    assert rerun["probes"] == first["probes"]
    other: list[int] = []
    bench_serve_probe.recorded_probe(fake_probe(100, 1050, other), path, dict(key, cap_bytes=2050))(4)
    assert other == [4] and len(ran) == len(set(ran))
