"""train_gates.py and an output_dir that already holds a run: refuse, resume the latest complete
checkpoint, or overwrite."""

import json
import shutil

from test_trainer_script import load_script, problems_file, tiny_model_dir, write_recipe  # noqa: F401 (fixtures)


def test_existing_run_is_refused_resumed_or_overwritten(tmp_path, tiny_model_dir, problems_file, capsys):  # noqa: F811
    recipe = write_recipe(tmp_path, model_name_or_path=str(tiny_model_dir), dataset_name=str(problems_file))
    script, out = load_script(), tmp_path / "run"
    assert script.main(["--config", str(recipe)]) == 0
    capsys.readouterr()

    # a second run into the same output_dir would mix two runs
    assert script.main(["--config", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert "output_dir" in err and "--resume_from_checkpoint true" in err and "--overwrite_output_dir" in err
    assert len(err.strip().splitlines()) == 1

    # a checkpoint cut short by a kill (no trainer_state.json) points to the last complete one
    shutil.copytree(out / "checkpoint-2", out / "checkpoint-3")
    (out / "checkpoint-3" / "trainer_state.json").unlink()
    assert script.main(["--config", str(recipe), "--resume_from_checkpoint", str(out / "checkpoint-3")]) == 2
    err = capsys.readouterr().err
    assert "trainer_state.json" in err and str(out / "checkpoint-2") in err

    # `true` resumes the latest complete checkpoint (checkpoint-2, not the cut checkpoint-3)
    assert script.main(["--config", str(recipe), "--resume_from_checkpoint", "true", "--max_steps", "3"]) == 0
    state = json.loads((out / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["global_step"] == 3 and len(state["log_history"]) >= 3

    # an explicit overwrite starts over: no checkpoint of the old run is left beside the new ones
    assert script.main(["--config", str(recipe), "--overwrite_output_dir", "true", "--max_steps", "1"]) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1"]
    assert json.loads((out / "checkpoint-1" / "trainer_state.json").read_text())["global_step"] == 1
