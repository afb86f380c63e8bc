"""The README's shell commands run in the order shown on a fresh checkout (issue 68), at smoke size.

Every ```bash block of README.md is either run here, line by line in one bash session in a scratch copy
of the checkout's inputs, with the smoke substitutions below (fewer problems and steps, the same
commands and flags otherwise), or named in NOT_RUN with the reason."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), flags=re.S)

# first command of a block -> why this test does not run it
NOT_RUN = {
    "make demo": "the quickstart: `make demo` is CI's and the demo tests' own run, `make test` is this suite",
    "rlkv serve": "needs vLLM (.venv-vllm) and a real model: tests/vllm_tier runs serve and export-vllm",
}
SMOKE = {
    "--num 240": "--num 24",
    "0-16:48,16-48:48": "0-16:4,16-48:4",
    "--config recipes/demo.yaml": "--config recipes/demo.yaml --max_steps 4 --save_steps 2 --report_to none",
    "checkpoint-30": "checkpoint-4",
}


def _commands(block: str) -> list[str]:
    """The block's commands: continuation lines joined, comments dropped."""
    text = block.replace("\\\n", " ")
    return [re.sub(r"\s+#.*$", "", line).strip() for line in text.splitlines() if line.strip()]


def test_every_bash_block_is_run_or_named():
    firsts = [_commands(b)[0] for b in BLOCKS]
    run = [f for f in firsts if not any(f.startswith(k) for k in NOT_RUN)]
    assert len(run) == 1 and run[0] == ". .venv/bin/activate", firsts
    assert all(any(f.startswith(k) for f in firsts) for k in NOT_RUN)  # no stale entry


@pytest.mark.skipif(sys.platform != "linux", reason="bash session on Linux")
def test_the_training_block_runs_in_order_on_a_fresh_checkout(tmp_path):
    block = next(b for b in BLOCKS if _commands(b)[0] == ". .venv/bin/activate")
    script = "\n".join(_commands(block))
    for long, smoke in SMOKE.items():
        assert long in script, long
        script = script.replace(long, smoke)
    # what a fresh clone holds; nothing from runs/
    for name in ("assets", "results", "recipes", "train_gates.py"):
        (tmp_path / name).symlink_to(ROOT / name)
    venv = tmp_path / ".venv" / "bin"  # the venv `make test` made, as the README's `.venv`
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{Path(sys.executable).parent}:$PATH"\n')
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        ["bash", "-e", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    mask = tmp_path / "masks" / "demo"
    assert (mask / "head_mask.json").is_file() and (mask / "head_mask.tsv").is_file()
    assert shutil.which("accelerate", path=str(Path(sys.executable).parent))
