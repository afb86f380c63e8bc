"""scripts/build_demo_model.py end to end on a tiny setting: a loadable model folder, its card and numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from rlkv.data.chain_task import load_chain_task

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--layers", "1", "--hidden", "32", "--heads", "2", "--kv-heads", "2", "--head-dim", "16"]
TINY += ["--intermediate", "64", "--steps", "3", "--batch", "2", "--eval-problems", "3", "--threads", "1"]


def build(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "scripts/build_demo_model.py", "--out", str(out), *TINY, *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_tiny_build_writes_a_loadable_model_with_its_card(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "demo-model"
    proc = build(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-model"]  # the temp dir was renamed away
    report = json.loads((out / "eval.json").read_text())
    assert report["build"]["steps"] == 3 and report["test_problems"] == 3
    assert len(report["single_head_compressed"]) == 1 and len(report["single_head_compressed"][0]) == 2
    assert [e["step"] for e in report["train_log"]] == [3]
    card = (out / "README.md").read_text()
    assert f"| full | {report['full_kv_accuracy']:.3f} |" in card
    assert "Status: not fit for purpose" in card  # 3 steps cannot reach the 90% target, and the card says so

    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert model.config.num_hidden_layers == 1 and model.config.model_type == "llama"
    row = load_chain_task("test", num=1)[0]
    ids = tok(row["problem"] + " " + row["solution"])["input_ids"]
    assert tok.unk_token_id not in ids  # the word-level vocabulary covers the task


def test_rebuild_replaces_the_folder_atomically(tmp_path):
    out = tmp_path / "demo-model"
    out.mkdir()
    (out / "stale.txt").write_text("from an older build")
    proc = build(out, "--skip-sweep")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (out / "stale.txt").exists()
    assert "single_head_compressed" not in json.loads((out / "eval.json").read_text())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo-model"]
