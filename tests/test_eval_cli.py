"""`rlkv eval` from the command line: recipes parse, a SIGKILLed run resumes to the uninterrupted result."""

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rlkv.cli import main
from rlkv.eval import EvalConfig, read_results, run_eval
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model

RECIPES = sorted((Path(__file__).parent.parent / "recipes" / "eval").glob("*.yaml"))
DEMO = str(Path(__file__).parent.parent / "assets" / "demo-model")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_are_valid_configs(recipe):
    cfg = EvalConfig.from_yaml(recipe)
    assert cfg.budget_rule == "matched" and "full" in cfg.methods


def test_unknown_recipe_field_is_named(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: tiny:llama\nsparsity: 0.5\n")
    with pytest.raises(ValueError, match="sparsity"):
        EvalConfig.from_yaml(path)


def _recipe(tmp_path, out, num_problems=4):
    mask = tmp_path / "mask.json"
    HeadMask.random(tiny_model("llama"), seed=5).save(mask)
    recipe = tmp_path / "recipe.yaml"
    doc = {
        "model": "tiny:llama",
        "head_mask": str(mask),
        "benchmarks": ["chain"],
        "methods": ["full", "rlkv", "streaming"],
        "sparsities": [0.5, 0.75],
        "num_problems": num_problems,
        "max_new_tokens": 24,
        "batch_size": 1,
    }
    recipe.write_text(yaml.safe_dump(doc))
    return ["eval", "--config", str(recipe), "--out", str(tmp_path / out), "--no-progress"]


def _without_timing(rows):
    return {r["key"]: {k: v for k, v in r.items() if k != "seconds"} for r in rows}


def _report_without_wall_time(report: str) -> str:
    """report.md less its wall-clock parts (the header's total and the last section, summed row seconds):
    the rest is results, which a resumed run must reproduce exactly."""
    body, wall = report.split("## Generation wall time (s)")
    assert "| full |" in wall  # the section is there, only its numbers vary
    return re.sub(r"; generation wall time \d+ s\n", "\n", body)


def test_sigkilled_run_resumes_to_the_uninterrupted_result(tmp_path):
    """Killed twice (after 6 rows, then its rerun after 13), then run again: every row once, as uninterrupted.
    Six problems (30 rows) leave 17 rows after the second kill point: rows come every ~35 ms here, so the
    poll below has half a second to see the count before the run could finish its last row."""
    args = _recipe(tmp_path, "killed", num_problems=6)
    results = tmp_path / "killed" / "results.jsonl"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    total = 6 * (1 + 2 * 2)
    for rows_before_kill in (6, 13):
        proc = subprocess.Popen(
            [sys.executable, "-c", "import sys; from rlkv.cli import main; main(sys.argv[1:])", *args],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None:
            if results.exists() and len(results.read_bytes().splitlines()) >= rows_before_kill:
                break
            time.sleep(0.005)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        partial = read_results(results)
        assert rows_before_kill <= len(partial) < total
        assert len({row["key"] for row in partial}) == len(partial)  # no row twice

    assert main(args) == 0  # resume
    resumed = read_results(results)
    assert len(resumed) == total
    assert main(_recipe(tmp_path, "reference", num_problems=6)) == 0  # the same run, uninterrupted
    assert _without_timing(resumed) == _without_timing(read_results(tmp_path / "reference" / "results.jsonl"))
    report = (tmp_path / "killed" / "report.md").read_text()
    assert "## chain: pass@1 (%)" in report
    reference = (tmp_path / "reference" / "report.md").read_text()
    # not byte for byte: the wall times differ (3 s vs 2 s seen under load)
    assert _report_without_wall_time(report) == _report_without_wall_time(reference)

    assert main(["eval", "--report-only", "--out", str(tmp_path / "killed")]) == 0


def test_missing_head_mask_fails_before_any_work(tmp_path, capsys):
    assert (
        main(["eval", "--model", "tiny:llama", "--methods", "full,rlkv", "--out", str(tmp_path / "x")]) == 2
    )
    assert "rlkv eval: error: " in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="vLLM installed: the vLLM tier runs it"
)
def test_the_vllm_engine_without_vllm_is_one_line_naming_the_install(tmp_path, capsys):
    args = ["eval", "--model", DEMO, "--engine", "vllm", "--methods", "full", "--out", str(tmp_path / "x")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "pip install 'rlkv[vllm]'" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["eval", "--methods", "full,rlkv", "--head-mask", "m.json"],
        ["data", "curriculum", "--problems", "chain"],
    ],
    ids=["eval", "curriculum"],
)
def test_a_tiny_model_on_the_vllm_engine_is_one_line_naming_the_fix(tmp_path, command):
    """`--help` offers tiny:<family>, which vLLM cannot load: refused before any model or vLLM loads (a
    subprocess, so the check is seen to need no vLLM import, whether vLLM is installed or not)."""
    code = (
        "import sys; from rlkv.cli import main; rc = main(sys.argv[1:]); "
        "assert 'vllm' not in sys.modules; sys.exit(rc)"
    )
    args = [*command, "--model", "tiny:llama", "--engine", "vllm", "--out", str(tmp_path / "x")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot load tiny:llama" in proc.stderr and "the transformers engine" in proc.stderr
    assert "--model assets/demo-model" in proc.stderr
    assert not (tmp_path / "x").exists()


def test_the_first_line_names_the_engine_of_each_method(tmp_path, capsys):
    args = _recipe(tmp_path, "plan") + [
        "--methods",
        "full,streaming",
        "--sparsities",
        "0.5",
        "--num-problems",
        "1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "engine: transformers for full, streaming"
    assert not any("vLLM engine" in line for line in out)  # no vLLM engine ran
    assert out[-1] == str(tmp_path / "plan" / "report.md")


def test_a_grid_of_full_alone_reports_full_pass_at_one(tmp_path, capsys):
    """`--methods full --sparsities 0.5`: full has no sparsity, so its table is one column of full KV."""
    args = _recipe(tmp_path, "full") + ["--methods", "full", "--sparsities", "0.5", "--num-problems", "2"]
    assert main(args) == 0
    rows = read_results(tmp_path / "full" / "results.jsonl")
    solved = 100 * sum(r["correct"] for r in rows) / 2
    report = (tmp_path / "full" / "report.md").read_text()
    assert f"| method | s=0 (full KV) |\n| --- | ---: |\n| full | {solved:.1f} |" in report
    assert "| method |  |" not in report


def test_unusable_policy_settings_fail_before_generating(tmp_path):
    # a policy kwarg that does not exist is caught before any generation
    with pytest.raises(ValueError, match="rpc"):
        run_eval(
            EvalConfig(
                model="tiny:llama",
                out=str(tmp_path / "bad"),
                methods=["full", "rpc"],
                policy_kwargs={"rpc": {"no_such_arg": 1}},
                num_problems=1,
                progress=False,
            )
        )
    assert not (tmp_path / "bad" / "results.jsonl").exists()


def test_redo_drops_the_named_methods_rows_and_runs_them_again(tmp_path, capsys):
    args = _recipe(tmp_path, "redo") + [
        "--methods",
        "full,streaming",
        "--sparsities",
        "0.5",
        "--num-problems",
        "2",
    ]
    assert main(args) == 0
    results = tmp_path / "redo" / "results.jsonl"
    first = read_results(results)
    capsys.readouterr()
    assert main(args + ["--redo", "streaming"]) == 0
    assert "--redo: dropped 2 rows of streaming" in capsys.readouterr().out
    rows = read_results(results)
    assert [r["method"] for r in rows] == ["full", "full", "streaming", "streaming"]
    assert _without_timing(rows) == _without_timing(first)  # greedy: the same rows again


def test_report_only_reports_the_grid_the_flags_name(tmp_path):
    """Two runs into one folder (rlkv at 0.5, then streaming at 0.75): `--report-only` with grid flags
    reports exactly the cells they name, whatever ran last; with --out alone, the last run's cells."""
    import json

    args = _recipe(tmp_path, "grid")
    out = tmp_path / "grid"
    assert main([*args, "--methods", "full,rlkv", "--sparsities", "0.5"]) == 0
    assert main([*args, "--methods", "full,streaming", "--sparsities", "0.75"]) == 0

    def reported() -> dict:
        return json.loads((out / "report.json").read_text())["benchmarks"]["chain"]["pass_at_1"]

    assert main(["eval", "--report-only", "--out", str(out)]) == 0
    assert set(reported()) == {"full", "streaming"}
    assert main([*args, "--report-only", "--methods", "full,rlkv,streaming", "--sparsities", "0.5,0.75"]) == 0
    assert set(reported()) == {"full", "rlkv", "streaming"}
    assert set(reported()["rlkv"]) == {"0.5"} and set(reported()["streaming"]) == {"0.75"}
    assert main([*args, "--report-only", "--methods", "rlkv", "--sparsities", "0.5"]) == 0
    assert set(reported()) == {"rlkv"}
