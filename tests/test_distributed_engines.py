"""FSDP2 / DeepSpeed ZeRO-3 accelerate configs on a CPU-only machine: refused with one clear line.

accelerate selects FSDP or DeepSpeed only on an accelerator; on CPU ranks it silently falls back to
plain DDP over gloo (or each rank training alone). train_gates.py refuses instead of running
another engine than the one the config names.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from rlkv.data.chain_task import chain_problems
from rlkv.testing import tiny_model, tiny_tokenizer

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).parent / "accelerate"

pytestmark = [
    pytest.mark.skipif(not ACCELERATE.exists(), reason="no accelerate launcher in this environment"),
    pytest.mark.skipif(torch.accelerator.is_available(), reason="checks the CPU-only behaviour"),
]


def _run(tmp_path: Path, accelerate_config: str, processes: int = 2) -> subprocess.CompletedProcess:
    tiny_model("qwen2").save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    rows = [
        {"problem": p.problem, "answer": p.answer, "source": "chain"} for p in chain_problems("train", num=4)
    ]
    (tmp_path / "chain.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {
        "model_name_or_path": str(tmp_path / "model"),
        "dataset_name": str(tmp_path / "chain.jsonl"),
        "prompt_template": "plain",
        "output_dir": str(tmp_path / "run"),
        "report_to": "none",
        "per_device_train_batch_size": 2,
        "num_generations": 2,
        "max_completion_length": 4,
        "max_steps": 1,
    }
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / "recipes/accelerate" / accelerate_config)]
    cmd += ["--num_processes", str(processes), "--mixed_precision", "no", "--main_process_port", str(port)]
    cmd += [str(REPO / "train_gates.py"), "--config", str(tmp_path / "recipe.yaml")]
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)


def _check_refused(proc: subprocess.CompletedProcess, engine: str) -> None:
    assert proc.returncode != 0
    assert f"train_gates.py: error: bad recipe: the accelerate config asks for {engine}" in proc.stderr
    assert "multi_process_cpu.yaml" in proc.stderr
    assert "ValueError" not in proc.stderr  # one line per rank; the launcher then reports the failed ranks


def test_fsdp2_on_cpu_ranks_is_refused_instead_of_running_ddp(tmp_path):
    proc = _run(tmp_path, "fsdp.yaml")
    _check_refused(proc, "FSDP")
    assert not (tmp_path / "run" / "head_mask.json").exists()


def test_one_process_fsdp2_on_cpu_is_refused_instead_of_training_unsharded(tmp_path):
    # recipes/accelerate/fsdp_one_gpu.yaml is the world-size-1 FSDP2 run for one GPU; on CPU accelerate
    # would start it and train without FSDP
    proc = _run(tmp_path, "fsdp_one_gpu.yaml", processes=1)
    _check_refused(proc, "FSDP")
    assert "single_process.yaml" in proc.stderr
    assert not (tmp_path / "run" / "head_mask.json").exists()


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed")
def test_deepspeed_zero3_on_cpu_ranks_is_refused_instead_of_running_ddp(tmp_path):
    proc = _run(tmp_path, "deepspeed_zero3.yaml")
    _check_refused(proc, "DeepSpeed")
