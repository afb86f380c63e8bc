"""Long jobs under faults: two writers on one folder, garbled results, changed settings, a full disk,
bad inputs, leftovers of killed writes: each one clear line naming the fix, nothing lost or mixed."""

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlkv._io import LOCK_FILE, FolderLock, atomic_write_text
from rlkv.cli import main
from rlkv.errors import UserInputError, run_reporting_user_errors
from rlkv.eval import read_results
from rlkv.trainers.script import resolve_output_dir


def _eval_args(tmp_path: Path, out: str, **overrides) -> list[str]:
    doc = {
        "model": "tiny:llama",
        "benchmarks": ["chain"],
        "methods": ["full", "random-evict"],
        "sparsities": [0.5],
        "num_problems": 3,
        "max_new_tokens": 16,
        "batch_size": 1,
        **overrides,
    }
    recipe = tmp_path / f"{out}.yaml"
    recipe.write_text(yaml.safe_dump(doc))
    return ["eval", "--config", str(recipe), "--out", str(tmp_path / out), "--no-progress"]


def test_a_second_job_on_a_locked_folder_refuses_naming_the_holder(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from rlkv._io import FolderLock\n"
            "with FolderLock(sys.argv[1], 'rlkv eval'):\n    print('held', flush=True); time.sleep(60)",
            str(folder),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout.readline().strip() == b"held"
        with pytest.raises(UserInputError, match=rf"another job is writing.*rlkv eval.*{holder.pid}"):
            with FolderLock(folder, "rlkv eval", UserInputError):
                pass
    finally:
        holder.kill()  # kill -9: the kernel drops the lock with the process
        holder.wait()
    with FolderLock(folder, "rlkv eval", UserInputError):  # a dead holder never blocks the rerun
        assert json.loads((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (folder / LOCK_FILE).exists()  # removed on exit


def test_two_evals_on_one_folder_the_second_refuses(tmp_path, capsys):
    args = _eval_args(tmp_path, "shared")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rlkv.cli import main; sys.exit(main(sys.argv[1:]))", *args],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    lock = tmp_path / "shared" / LOCK_FILE
    deadline = time.time() + 120
    while time.time() < deadline and first.poll() is None and not lock.exists():
        time.sleep(0.02)
    assert first.poll() is None, "the first eval ended before the check"
    assert main(args) == 2
    assert "another job is writing this folder" in capsys.readouterr().err
    assert first.wait(timeout=300) == 0
    rows = read_results(tmp_path / "shared" / "results.jsonl")
    assert len(rows) == len({r["key"] for r in rows}) == 6  # every key once


def test_garbled_middle_line_and_changed_settings_are_one_line(tmp_path, capsys):
    args = _eval_args(tmp_path, "run")
    assert main(args) == 0
    results = tmp_path / "run" / "results.jsonl"
    lines = results.read_text().splitlines(keepends=True)
    assert main(_eval_args(tmp_path, "run", max_new_tokens=12)) == 2  # a row-defining setting changed
    assert "made with other settings" in capsys.readouterr().err
    results.write_text(lines[0] + "{garbled\n" + "".join(lines[1:]))
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "line 2 is not valid JSON" in err and "delete that line" in err and "Traceback" not in err


def test_num_problems_zero_is_refused_before_any_file(tmp_path, capsys):
    assert main(_eval_args(tmp_path, "none", num_problems=0)) == 2
    assert "num_problems=0" in capsys.readouterr().err
    assert not (tmp_path / "none").exists()


def test_a_full_disk_is_one_line_and_leaves_no_temp_file(tmp_path, capsys):
    def fill():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "report.md"))

    assert run_reporting_user_errors("rlkv eval", fill) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no space left" in err and "report.md" in err

    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rlkv.eval.plots import save_figure

    fig = plt.figure()
    fig.savefig = lambda *a, **k: (Path(a[0]).write_bytes(b"half"), fill())  # the disk fills mid-write
    with pytest.raises(OSError):
        save_figure(fig, tmp_path / "plot.png")
    assert list(tmp_path.iterdir()) == []  # no half-written image, no temp file


def test_killed_writes_leave_no_temp_files_and_an_empty_checkpoint_names_the_way_out(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoint-4").mkdir(parents=True)  # killed while creating its first checkpoint
    (run / "checkpoint-4" / ".head_mask.json.abc123.tmp").write_text("{")
    with pytest.raises(UserInputError, match="--overwrite_output_dir true"):
        resolve_output_dir(str(run), None, overwrite=False, main_process=True)
    with pytest.raises(UserInputError, match="--overwrite_output_dir true"):
        resolve_output_dir(str(run), "true", overwrite=False, main_process=True)
    assert not (run / "checkpoint-4" / ".head_mask.json.abc123.tmp").exists()
    assert resolve_output_dir(str(run), None, overwrite=True, main_process=True) is None
    atomic_write_text(tmp_path / "kept.txt", "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kept.txt", "run"]


def test_a_trainer_state_cut_short_by_a_kill_is_not_a_complete_checkpoint(tmp_path):
    """transformers writes trainer_state.json last and in place: a kill mid-write leaves it empty or torn."""
    run = tmp_path / "run"
    for step, state in ((1, '{"global_step": 1}\n'), (2, ""), (3, '{"global_step": 3, "log_h')):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(state)
    assert resolve_output_dir(str(run), "true", overwrite=False, main_process=True) == str(
        run / "checkpoint-1"
    )
    for torn in (2, 3):
        with pytest.raises(UserInputError, match="not a complete checkpoint.*checkpoint-1"):
            resolve_output_dir(str(run), str(run / f"checkpoint-{torn}"), overwrite=False, main_process=True)


def test_a_mask_folder_whose_tsv_disagrees_with_its_json_is_refused(tmp_path):
    from rlkv.head_mask import HeadMask, HeadMaskError
    from rlkv.testing import tiny_model

    model = tiny_model("llama")
    folder = tmp_path / "mask"
    HeadMask.random(model, seed=0).save_pretrained(folder)
    HeadMask.from_pretrained(folder, model)  # as written: agrees
    lines = (folder / "head_mask.tsv").read_text().splitlines()
    lines[1] = "\t".join(["0.5"] * len(lines[1].split("\t")))
    (folder / "head_mask.tsv").write_text("\n".join(lines) + "\n")
    with pytest.raises(HeadMaskError, match=r"head_mask.tsv disagrees with head_mask.json \(layer 1"):
        HeadMask.from_pretrained(folder, model)


def test_an_empty_or_overlong_prompt_is_one_line(tmp_path, capsys):
    demo = str(Path(__file__).resolve().parents[1] / "assets" / "demo-model")
    base = ["generate", "--model", demo, "--no-compression", "--max-new-tokens", "2"]
    assert main([*base, "--prompt", " "]) == 2
    assert "--prompt 1 is empty" in capsys.readouterr().err
    assert main([*base, "--no-chat-template", "--prompt", "a " * 1500]) == 2
    assert "more than the model's 1024 positions" in capsys.readouterr().err


def test_a_misspelled_recipe_field_is_named_with_the_close_match(tmp_path, capsys):
    from rlkv.trainers.script import main as train_main

    recipe = tmp_path / "bad.yaml"
    demo = Path(__file__).resolve().parents[1] / "assets" / "demo-model"
    recipe.write_text(f"model_name_or_path: {demo}\ndataset_name: x\nlearning_rat: 0.1\n")
    with pytest.raises(SystemExit) as exit_:
        train_main(["--config", str(recipe)], "train_gates.py")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown field 'learning_rat' (did you mean 'learning_rate'" in err and "dataclass" not in err


def test_another_models_curriculum_is_refused(tmp_path, capsys):
    from rlkv.trainers.script import main as train_main

    root = Path(__file__).resolve().parents[1]
    qwen_curriculum = root / "results" / "curricula" / "qwen2.5-coder-0.5b-instruct"
    argv = ["--config", str(root / "recipes" / "demo.yaml"), "--output_dir", str(tmp_path / "run" / "gates")]
    with pytest.raises(SystemExit) as exit_:
        train_main([*argv, "--dataset_name", str(qwen_curriculum)], "train_gates.py")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "generated by 'models/qwen2.5-coder-0.5b-instruct' (qwen2), not by this llama model" in err
    assert not (tmp_path / "run").exists()
