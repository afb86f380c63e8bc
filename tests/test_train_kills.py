"""train_gates.py killed with SIGKILL at several points, then run again: nothing lost, nothing mixed.

One output_dir takes three kills (the first checkpoint's folder just made, so mostly mid-write;
the second checkpoint just complete, so mid-step; a seeded moment after the third checkpoint's
folder appears), each followed by the command the refusal names (`--resume_from_checkpoint true`,
or `--overwrite_output_dir true` when no checkpoint is complete). The run then ends with the head
mask, gates and logged rewards of an uninterrupted run with the same seed, byte for byte, and no
temp file or incomplete checkpoint is left. While the last rerun trains, a second run into the
same folder refuses in one line naming it (the folder lock), and the lock is gone once it ends.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors import safe_open
from test_trainer_script import REPO, load_script, problems_file, tiny_model_dir, write_recipe  # noqa: F401

from rlkv._io import LOCK_FILE
from rlkv.errors import UserInputError
from rlkv.trainers.script import is_complete_checkpoint, resolve_output_dir

MAX_STEPS = 4
_TIMING_KEYS = ("step_time", "runtime", "per_second", "total_flos")  # wall clock, not results


def _launch(recipe: Path, *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, str(REPO / "train_gates.py"), "--config", str(recipe), *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


def _kill_when(proc: subprocess.Popen, ready, delay: float = 0.0) -> None:
    """SIGKILL `proc` `delay` seconds after `ready()` first holds; fails if the run ends first."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.002)
    time.sleep(delay)
    proc.kill()
    _, err = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]


def _rerun_flags(out: Path) -> list[str]:
    """What the refusal of a plain rerun points to, checked against the folder's state."""
    if any(is_complete_checkpoint(p) for p in out.glob("checkpoint-*")):
        return ["--resume_from_checkpoint", "true"]
    with pytest.raises(UserInputError, match="--overwrite_output_dir true"):
        resolve_output_dir(str(out), "true", overwrite=False, main_process=False)
    return ["--overwrite_output_dir", "true"]


def _assert_run_mask_is_a_checkpoints(out: Path) -> None:
    """The run's head mask (refreshed at every save, atomically) is some checkpoint's, never a torn one."""
    if (out / "head_mask.json").exists():
        run_mask = (out / "head_mask.json").read_bytes()
        saved = [p / "head_mask.json" for p in out.glob("checkpoint-*") if (p / "head_mask.json").is_file()]
        assert any(run_mask == p.read_bytes() for p in saved)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _gates(run: Path) -> tuple[dict, dict]:
    with safe_open(run / "gates.safetensors", "pt") as f:
        return f.metadata(), {key: f.get_tensor(key).tolist() for key in f.keys()}


def _logged(run: Path) -> list[dict]:
    state = json.loads((run / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").read_text())
    return [
        {k: v for k, v in entry.items() if not any(t in k for t in _TIMING_KEYS)}
        for entry in state["log_history"]
    ]


def test_three_kills_then_the_named_command_end_as_the_uninterrupted_run(
    tmp_path,
    tiny_model_dir,  # noqa: F811
    problems_file,  # noqa: F811
    capsys,
):
    fields = dict(
        model_name_or_path=str(tiny_model_dir), dataset_name=str(problems_file), max_steps=MAX_STEPS
    )
    (tmp_path / "reference").mkdir()
    reference = write_recipe(tmp_path / "reference", **fields)
    assert load_script().main(["--config", str(reference)]) == 0
    straight = tmp_path / "reference" / "run"

    (tmp_path / "killed").mkdir()
    recipe = write_recipe(tmp_path / "killed", **fields)
    out = tmp_path / "killed" / "run"
    kills = [
        (lambda: (out / "checkpoint-1").is_dir(), 0.0),
        (lambda: (out / "checkpoint-2" / "trainer_state.json").is_file(), 0.0),
        (lambda: (out / "checkpoint-3").is_dir(), random.Random(0).uniform(0.0, 0.03)),
    ]
    flags: list[str] = []
    for ready, delay in kills:
        _kill_when(_launch(recipe, *flags), ready, delay)
        assert not (out / f"checkpoint-{MAX_STEPS}" / "trainer_state.json").exists()  # killed before the end
        _assert_run_mask_is_a_checkpoints(out)
        flags = _rerun_flags(out)
    final = _launch(recipe, *flags)
    # meanwhile a second run into the same folder refuses, naming the first (the main process's lock)
    deadline = time.time() + 120
    holder = f'"pid": {final.pid}'  # not just the lock file: the killed runs left theirs (unlocked)
    while time.time() < deadline and final.poll() is None and holder not in _read(out / LOCK_FILE):
        time.sleep(0.005)
    assert final.poll() is None, "the rerun ended before the check"
    capsys.readouterr()
    assert load_script().main(["--config", str(recipe), "--resume_from_checkpoint", "true"]) == 2
    refusal = capsys.readouterr().err
    assert "another job is writing this folder" in refusal and holder in refusal, refusal
    assert len(refusal.strip().splitlines()) == 1
    _, err = final.communicate(timeout=300)
    assert final.returncode == 0, err.decode()[-2000:]

    for name in ("head_mask.json", "head_mask.tsv"):
        assert (out / name).read_bytes() == (straight / name).read_bytes(), name
    # safetensors orders its header's metadata differently in each process: compare what it holds
    assert _gates(out) == _gates(straight)
    logged, logged_straight = _logged(out), _logged(straight)
    assert len(logged) == MAX_STEPS
    assert logged == logged_straight  # rewards, losses, gate statistics of every step

    checkpoints = sorted(p.name for p in out.glob("checkpoint-*"))
    assert checkpoints == [f"checkpoint-{step}" for step in range(1, MAX_STEPS + 1)]
    assert all(is_complete_checkpoint(out / name) for name in checkpoints)
    assert not [p for p in out.rglob("*") if p.name.startswith(".") or p.name.endswith(".tmp")]  # lock too
