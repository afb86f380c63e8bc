"""scripts/demo.py --device: every step's own parser receives the device (the run itself is
tests/test_demo_pipeline.py on CPU; on a GPU machine scripts/gpu_train_check.sh runs it with cuda)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import demo  # noqa: E402


def _rlkv_args(command: list[str]):
    from rlkv.cli import build_parser

    assert command[:3] == [sys.executable, "-m", "rlkv.cli"]  # no console script needed
    args, extra = build_parser().parse_known_args(command[3:])
    assert extra == []
    return args


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_every_step_receives_the_device(tmp_path, device):
    from trl import ModelConfig, TrlParser

    from rlkv.trainers import GateGRPOConfig
    from rlkv.trainers.script import ScriptArguments

    model = ROOT / "assets" / "demo-model"
    assert _rlkv_args(demo.curriculum_command(model, tmp_path, device, smoke=True)).device == device
    assert _rlkv_args(demo.eval_command(model, tmp_path, device, smoke=True)).device == device
    assert _rlkv_args(demo.ablation_command(model, tmp_path, device, smoke=True)).device == device

    train = demo.train_command(model, tmp_path, device, smoke=True)
    assert train[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    recipe_args = train[train.index("train_gates.py") + 1 :]
    parser = TrlParser((ScriptArguments, GateGRPOConfig, ModelConfig))
    script_args, training_args, _ = parser.parse_args_and_config(
        args=[a if a != "recipes/demo.yaml" else str(ROOT / a) for a in recipe_args]
    )
    # TRL / transformers pick the accelerator unless use_cpu: the recipe's `use_cpu: true` is overridden
    assert training_args.use_cpu is (device == "cpu")
    assert script_args.dataset_name == str(tmp_path / "curriculum" / "dataset")


def test_unknown_device_is_refused_with_the_choices(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--device", "tpu", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--device 'tpu': choose one of cpu, cuda" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_cuda_without_a_gpu_is_refused_before_any_step(tmp_path):
    proc = subprocess.run(
        [sys.executable, "scripts/demo.py", "--device", "cuda", "--out", str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "torch sees no CUDA device" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_the_cli_runs_as_a_module_without_its_console_script():
    proc = subprocess.run(
        [sys.executable, "-m", "rlkv.cli", "data", "curriculum", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--device" in proc.stdout
