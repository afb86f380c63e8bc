"""`rlkv serve`: stock `vllm serve` with the head split, answering /v1/completions over loopback; a user's
--hf-overrides merged, concurrent requests equal to sequential ones, malformed ones a 4xx, and no vLLM
process outliving `kill -9` of the command (nor of `rlkv eval --engine vllm`)."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO, engine  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.data.chain_task import load_chain_task  # noqa: E402
from rlkv.data.prompts import build_prompt  # noqa: E402
from rlkv.inference import load  # noqa: E402
from rlkv.inference.vllm import vllm_overrides  # noqa: E402

START_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def test_rlkv_serve_answers_completions_with_the_offline_engines_tokens(tmp_path):
    model, tokenizer = load(DEMO, dtype="float32")
    mask = HeadMask.random(model, seed=0)
    mask.save_pretrained(tmp_path / "mask")
    prompt = build_prompt(load_chain_task("test", 1)[0], tokenizer)
    with engine(hf_overrides=vllm_overrides(DEMO, mask, 0.5, window=64)) as llm:
        params = vllm.SamplingParams(temperature=0, max_tokens=40)
        want = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    port = _free_port()
    rlkv = Path(sys.executable).parent / "rlkv"
    command = [str(rlkv), "serve", *_split_flags(tmp_path)]
    command += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager"]
    command += ["--block-size", "32", "--max-model-len", "1024", "--seed", "0"]
    # a user's own overrides (a common vLLM flag) are merged into rlkv's, never replacing the split
    command += ["--hf-overrides", json.dumps({"max_position_embeddings": 1024})]
    log = open(tmp_path / "server.log", "w")
    # TRL, imported by other tests of this process, sets VLLM_LOGGING_LEVEL; the engine's lines are INFO
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_LOGGING_LEVEL": "INFO"}
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            try:
                _get(f"http://127.0.0.1:{port}/health")
                break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not start"
                time.sleep(1)
        answer = _complete(port, prompt)
        assert answer["choices"][0]["text"] == want  # the offline engine's text, same split
        assert "vllm:kv_cache_usage_perc" in _get(f"http://127.0.0.1:{port}/metrics")
        log_text = (tmp_path / "server.log").read_text()
        # the engine's own line, from the config it loaded: the head-mixed model with the mask's split
        assert "rlkv: RlkvLlamaForCausalLM serves 4 of 8 KV heads full" in log_text, log_text[-3000:]
        assert not _deprecations_of_the_server(log_text)  # none telling the user to run a failing command
        _concurrent_requests_equal_sequential_ones(port, tokenizer)
        _malformed_requests_are_4xx_and_the_server_serves_on(port, prompt, want)
        _no_process_outlives_a_kill(server)
    finally:
        if server.poll() is None:
            server.terminate()
            server.wait(timeout=60)
    _the_exported_folder_serves_with_the_command_export_prints(tmp_path, rlkv, env, prompt, want)


def _split_flags(tmp_path: Path) -> list[str]:
    """The model, the mask saved in `tmp_path` and the sparsity, as `rlkv serve` / `rlkv export-vllm` take them."""
    return ["--model", DEMO, "--head-mask", str(tmp_path / "mask"), "--sparsity", "0.5"]


def _deprecations_of_the_server(log_text: str) -> list[str]:
    """Log lines that call the server's own entry point deprecated (vLLM's `openai.api_server` module does)."""
    return [
        line
        for line in log_text.splitlines()
        if "deprecated" in line and ("serve" in line or "api_server" in line)
    ]


def _start(command: list[str], log_path: Path, env: dict, port: int) -> subprocess.Popen:
    """`command` started with its output in `log_path`, once /health answers."""
    server = subprocess.Popen(command, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert server.poll() is None, log_path.read_text()[-3000:]
        try:
            _get(f"http://127.0.0.1:{port}/health")
            return server
        except OSError:
            assert time.monotonic() < deadline, f"{command[:4]} did not start"
            time.sleep(1)


def _the_exported_folder_serves_with_the_command_export_prints(tmp_path, rlkv, env, prompt, want) -> None:
    """The deployment the guide documents: `rlkv export-vllm`, then the stock server command its last line
    names for the vLLM installed here (vllm-cpu: the server module, since its `vllm` command fails)."""
    out = tmp_path / "exported"
    export = [str(rlkv), "export-vllm", *_split_flags(tmp_path)]
    printed = subprocess.run([*export, "--out", str(out)], capture_output=True, text=True, check=True).stdout
    hint = printed.strip().splitlines()[-1].split("`")[1].split()
    assert hint[-1] == str(out) and hint[0] in ("vllm", "python"), printed
    command = (
        [sys.executable, *hint[1:]]
        if hint[0] == "python"
        else [str(Path(sys.executable).parent / "vllm"), *hint[1:]]
    )
    port = _free_port()
    command += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager"]
    command += ["--block-size", "32", "--max-model-len", "1024", "--seed", "0"]
    server = _start(command, tmp_path / "stock.log", env, port)
    try:
        answer = _complete(port, prompt, model=str(out))
        assert answer["choices"][0]["text"] == want  # the split carried by config.json
        log_text = (tmp_path / "stock.log").read_text()
        assert "rlkv: RlkvLlamaForCausalLM serves 4 of 8 KV heads full" in log_text, log_text[-3000:]
        assert not _deprecations_of_the_server(log_text)
    finally:
        server.terminate()
        server.wait(timeout=60)


def _complete(port: int, prompt, max_tokens: int = 40, model: str = DEMO) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as r:
        return json.loads(r.read())


def _concurrent_requests_equal_sequential_ones(port: int, tokenizer) -> None:
    prompts = [build_prompt(p, tokenizer) for p in load_chain_task("test", 16)]
    sequential = [_complete(port, p)["choices"][0]["text"] for p in prompts]
    with ThreadPoolExecutor(len(prompts)) as pool:
        concurrent = [a["choices"][0]["text"] for a in pool.map(lambda p: _complete(port, p), prompts)]
    assert concurrent == sequential


def _status(port: int, body: bytes) -> int:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _malformed_requests_are_4xx_and_the_server_serves_on(port: int, prompt: str, want: str) -> None:
    bad = [
        b"{not json",
        json.dumps({"model": DEMO}).encode(),  # no prompt
        json.dumps({"model": DEMO, "prompt": prompt, "max_tokens": -1}).encode(),
        json.dumps({"model": DEMO, "prompt": prompt, "temperature": "hot"}).encode(),
        json.dumps({"model": "another-model", "prompt": prompt}).encode(),
        json.dumps({"model": DEMO, "prompt": "x " * 3000, "max_tokens": 8}).encode(),  # over --max-model-len
    ]
    codes = [_status(port, body) for body in bad]
    assert all(400 <= c < 500 for c in codes), codes
    assert _complete(port, prompt)["choices"][0]["text"] == want


def _no_process_outlives_a_kill(process: subprocess.Popen) -> None:
    """kill -9 of `process`: every process below it (vLLM's engine core and workers) is gone within 10 s."""
    import psutil

    below = psutil.Process(process.pid).children(recursive=True)
    assert any("VLLM" in p.name() or "EngineCore" in " ".join(p.cmdline()) for p in below), below
    process.kill()
    process.wait(timeout=30)
    _, alive = psutil.wait_procs(below, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_killed_eval_leaves_no_vllm_process(tmp_path):
    """`rlkv eval --engine vllm` with vLLM's default engine processes, killed -9 mid-run."""
    import psutil

    rlkv = Path(sys.executable).parent / "rlkv"
    command = [str(rlkv), "eval", "--engine", "vllm", "--model", DEMO, "--methods", "full"]
    command += ["--benchmarks", "chain", "--num-problems", "48", "--max-new-tokens", "200"]
    command += ["--dtype", "float32", "--out", str(tmp_path / "eval"), "--no-progress"]
    env = os.environ | {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(tmp_path / "eval.log", "w")
    run = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any("VLLM::Worker" in p.name() for p in psutil.Process(run.pid).children(recursive=True)):
            assert run.poll() is None, (tmp_path / "eval.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the eval started no vLLM worker"
            time.sleep(0.5)
        _no_process_outlives_a_kill(run)
    finally:
        if run.poll() is None:
            run.kill()
