"""The vLLM commands a new user types first (issue 86): `rlkv eval --engine vllm` starts with its defaults on
the demo model (1024 positions, no memory setting), runs one dtype on both engines, returns each engine's
memory before the next starts, and every start failure is one line (exit 2) before vLLM loads."""

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from test_cli_errors import assert_one_error_line, run_cli  # noqa: E402
from vllm_engines import DEMO  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.eval import EvalConfig, run_eval  # noqa: E402
from rlkv.eval.results import read_results  # noqa: E402
from rlkv.inference import load, resolve_dtype  # noqa: E402
from rlkv.inference.dtypes import dtype_name  # noqa: E402
from rlkv.inference.vllm_engine import VLLMRunner  # noqa: E402

GiB = 1 << 30


@pytest.fixture(scope="module")
def mask_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mask")
    HeadMask.random(load(DEMO, dtype="float32")[0], seed=0).save_pretrained(folder)
    return str(folder)


def test_the_eval_starts_with_its_defaults_as_a_user_runs_it(tmp_path, mask_dir):
    """The README's first vLLM eval, as typed: no dtype, no memory setting, max_new_tokens 1024 on a model of
    1024 positions (widest prompt + 1024 > 1024), vLLM's own engine processes: exit 0 with rows in the dtype
    that `auto` chooses here, the cap and the KV size said in one line each, no traceback."""
    rlkv = Path(sys.executable).parent / "rlkv"
    command = [str(rlkv), "eval", "--engine", "vllm", "--model", DEMO, "--head-mask", mask_dir]
    command += ["--num-problems", "2", "--sparsities", "0.5", "--no-progress", "--out", str(tmp_path / "e")]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_ENABLE_V1_MULTIPROCESSING")
    }
    run = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert "capped at the model's 1024 positions" in output, output[-4000:]
    rows = read_results(tmp_path / "e" / "results.jsonl")
    assert len(rows) == 4 and {r["engine"] for r in rows} == {"vllm"}
    auto = dtype_name(resolve_dtype("auto", "cpu"))
    assert {r["dtype"] for r in rows} == {auto}
    assert f"- dtype: {auto}" in (tmp_path / "e" / "report.md").read_text()


def test_auto_resolves_once_and_vllm_runs_the_dtype_recorded():
    """vLLM's own "auto" downcasts an fp32 checkpoint to bf16; rlkv resolves it as the transformers engine does."""
    runner = VLLMRunner(DEMO, dtype="auto", enforce_eager=True)
    try:
        llm = runner.engine(None)
        assert runner.dtype == dtype_name(resolve_dtype("auto", "cpu"))
        assert llm.llm_engine.model_config.dtype == resolve_dtype("auto", "cpu")
    finally:
        runner.close()


def test_each_engine_returns_its_memory_before_the_next_starts(tmp_path):
    """Three head splits (three engines of 1 GiB of KV each, zero-filled so resident) in one eval: the process
    holds no more while the third runs than while the first ran, so the memory of one engine is enough."""
    rss = {}

    def on_row(row):
        rss.setdefault(row["method"], []).append(psutil.Process().memory_info().rss)

    methods = ["random-mask@1", "random-mask@2", "random-mask@3"]
    cfg = EvalConfig(
        model=DEMO,
        benchmarks=["chain"],
        num_problems=2,
        methods=methods,
        sparsities=[0.5],
        max_new_tokens=16,
        dtype="float32",
        engine="vllm",
        vllm_kwargs={"enforce_eager": True},
        progress=False,
        out=str(tmp_path / "three"),
    )
    before = psutil.Process().memory_info().rss
    run_eval(cfg, on_row=on_row)
    assert sorted(rss) == sorted(methods)
    first, last = max(rss[methods[0]]), max(rss[methods[2]])
    assert first - before > GiB * 3 / 4, (
        before / GiB,
        first / GiB,
    )  # an engine's KV is resident: a leak shows
    assert last - first < GiB / 2, (first / GiB, last / GiB)


@pytest.mark.parametrize(
    "flags, needles",
    [
        (["--vllm-arg", "bogus_setting=1"], ("'bogus_setting'", "takes no such argument", "--vllm-arg")),
        (
            ["--vllm-arg", f"kv_cache_memory_bytes={1 << 50}"],
            ("KV cache on CPU", "kv_cache_memory_bytes", "free"),
        ),
        (["--vllm-arg", "gpu_memory_utilization=1.0"], ("gpu_memory_utilization=1", "free memory")),
    ],
)
def test_a_start_that_cannot_succeed_is_one_line_before_vllm_loads(
    capsys, tmp_path, monkeypatch, flags, needles
):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    argv = ["eval", "--engine", "vllm", "--model", DEMO, "--methods", "full", "--num-problems", "2"]
    argv += ["--dtype", "float32", "--no-progress", "--out", str(tmp_path / "x"), *flags]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv eval", *needles)
    assert not read_results(tmp_path / "x" / "results.jsonl")  # nothing half-written: a rerun resumes it


def test_vllm_arg_without_the_vllm_engine_is_refused(capsys, tmp_path):
    argv = ["eval", "--model", DEMO, "--methods", "full", "--vllm-arg", "enforce_eager=true"]
    code, err = run_cli([*argv, "--out", str(tmp_path / "x")], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv eval", "--vllm-arg without --engine vllm")


@pytest.mark.parametrize("method", ["rlkv", "rlkv+rkv", "protected"])
def test_vllms_compiled_path_gives_the_eager_tokens(method):
    """vLLM's default (compiled, `enforce_eager=False`) runs rlkv's groups as the eager engine does: the eval's
    form and R-KV on the mask's compressed heads at s=0.75 (a compaction every step), 16 chain problems."""
    from vllm_engines import engine, greedy

    from rlkv.data.chain_task import load_chain_task
    from rlkv.data.prompts import build_prompt
    from rlkv.eval.methods import method_config
    from rlkv.inference.vllm import compression_overrides, vllm_compression

    model, tokenizer = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    if method == "protected":  # the protected form's ring
        config = vllm_compression(mask, 0.75, protect_prompt=True)
    else:
        config = method_config(
            method, 0.75, model=model, masks={"rlkv": mask}, policy_kwargs={"rkv": {"buffer": 0}}
        )
    overrides = compression_overrides(DEMO, config)
    prompts = [build_prompt(p, tokenizer) for p in load_chain_task("test", 16)]
    tokens = {}
    for eager in (True, False):
        extra = {"enable_prefix_caching": False} if method == "rlkv+rkv" else {}
        with engine(hf_overrides=overrides, enforce_eager=eager, **extra) as llm:
            tokens[eager] = greedy(llm, prompts, max_tokens=64)
    same = sum(a == b for a, b in zip(tokens[True], tokens[False], strict=True))
    assert same >= 15, same


def test_rlkv_serve_on_cpu_starts_with_rlkvs_dtype_and_a_kv_size_from_free_memory(monkeypatch, capsys):
    """What `rlkv serve` adds to vLLM's flags on the CPU platform where they say nothing (vLLM's defaults: bf16
    emulated on a CPU without native bf16, 92% of the machine less the RSS), and nothing where they do."""
    from rlkv.cli.serve import cpu_defaults
    from rlkv.inference.vllm import model_config

    config = model_config(DEMO)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    added = cpu_defaults(DEMO, config, ["--port", "9"])
    auto = dtype_name(resolve_dtype("auto", "cpu"))
    assert added[:4] == ["--port", "9", "--dtype", auto] and added[4] == "--kv-cache-memory-bytes", added
    assert 256 * 2**20 <= int(added[5]) <= 4 * GiB
    assert "rlkv: on CPU: --dtype" in capsys.readouterr().out
    mine = ["--dtype", "float32", "--gpu-memory-utilization", "0.3"]
    assert cpu_defaults(DEMO, config, mine) == mine
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    assert cpu_defaults(DEMO, config, ["--dtype=float32"]) == ["--dtype=float32"]
