"""`rlkv serve`: stock `vllm serve` with the head split, answering /v1/completions over loopback."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
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
    command = [
        str(rlkv),
        "serve",
        "--model",
        DEMO,
        "--head-mask",
        str(tmp_path / "mask"),
        "--sparsity",
        "0.5",
    ]
    command += ["--port", str(port), "--host", "127.0.0.1", "--dtype", "float32", "--enforce-eager"]
    command += ["--block-size", "32", "--max-model-len", "1024", "--seed", "0"]
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"}
    )
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
        body = json.dumps({"model": DEMO, "prompt": prompt, "max_tokens": 40, "temperature": 0}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["choices"][0]["text"] == want  # the offline engine's text, same split
        assert "vllm:kv_cache_usage_perc" in _get(f"http://127.0.0.1:{port}/metrics")
        assert "KV heads full" in (tmp_path / "server.log").read_text()
    finally:
        server.terminate()
        server.wait(timeout=60)
