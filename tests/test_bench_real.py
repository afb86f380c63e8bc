"""The real suite's inference measurement on the tiny model: its command line, its rates and its report row."""

import json
import subprocess
import sys

from benchmarks.common import ROOT, child_env
from benchmarks.real.runner import report_real
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model


def test_inference_worker_times_plain_dynamic_and_static_and_reports_them(tmp_path):
    mask = tmp_path / "mask"
    HeadMask.random(tiny_model("qwen2"), seed=0).save_pretrained(mask)
    command = [
        sys.executable,
        "-m",
        "benchmarks.real.runner",
        "--worker",
        "inference",
        "--model",
        "tiny:qwen2",
    ]
    command += [
        "--inference-prompt-tokens",
        "96",
        "--inference-decode-tokens",
        "6",
        "--inference-repeats",
        "1",
    ]
    command += ["--inference-head-mask", str(mask), "--threads", "1", "--dtype", "float32"]
    proc = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for kind in ("plain", "dynamic", "static"):
        assert result[f"{kind}_tok_s"] > 0 and result[f"{kind}_prefill_s"] > 0
        assert len(result["all_s"]["decode"][kind]) == 1 and result["all_s"]["decode"][kind][0] > 0
    assert (result["prompt_tokens"], result["decode_tokens"], result["sparsity"]) == (96, 6, 0.5)
    ratios = {k: result[f"{k}_tok_s"] / result["plain_tok_s"] for k in ("dynamic", "static")}
    lines = report_real(
        dict(
            model="tiny:qwen2",
            dtype="float32",
            completions=1,
            new_tokens=6,
            micro_batch=1,
            generate=dict(
                plain_tok_s=1.0,
                plain_generate_s=1.0,
                gated_tok_s=1.0,
                gated_generate_s=1.0,
                forward_backward_s=1.0,
                sequence_length=8,
            ),
            step=dict(step_s=1.0, generate_in_step_s=0.5, step_peak_rss=2**30, step_cpu_util=1.0, threads=1),
            small_setting=dict(completions=1, new_tokens=6),
            small_bf16=dict(step_s=1.0),
            small_fp32=dict(step_s=1.0),
            bf16_over_fp32=1.0,
            generate_ratio=1.0,
            step_ratio=1.0,
            inference=result,
            inference_ratios=ratios,
            verdicts=dict(
                generate=True, step=True, rss=True, cpu=True, inference=min(ratios.values()) >= 1.0
            ),
        )
    )
    row = next(line for line in lines if line.startswith("| greedy decode, batch 1, prompt 96, 6 new"))
    assert f"{result['static_tok_s']:.1f} tok/s" in row
    assert any(
        line.startswith("| batch 1, prompt 512") and f"{ratios['dynamic']:.2f}" in line for line in lines
    )
