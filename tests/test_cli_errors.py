"""Every entry point turns user errors into one `error:` line and exit status 2; bugs keep their traceback."""

from pathlib import Path

import pytest
from test_trainer_script import load_script

import rlkv.trainers.script as train_script
from rlkv import sandbox
from rlkv.cli import main
from rlkv.errors import UserInputError, is_user_error


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    """(exit status, stderr) of `rlkv ARGV`, run in this process."""
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def assert_one_error_line(err: str, prog: str, *needles: str) -> None:
    assert "Traceback" not in err and "usage:" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"{prog}: error: "), err
    for needle in needles:
        assert needle in last, (needle, last)


def test_generate_rejects_zero_new_tokens(capsys):
    code, err = run_cli(
        ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "0"], capsys
    )
    assert code == 2
    assert_one_error_line(err, "rlkv generate", "--max-new-tokens", ">= 1")


def test_generate_says_a_missing_model_path_does_not_exist(capsys, tmp_path):
    missing = tmp_path / "nonexistent"
    code, err = run_cli(["generate", "--model", str(missing), "--prompt", "hi"], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv generate", str(missing), "does not exist")


@pytest.mark.parametrize(
    "content, needle",
    [("", "empty"), ('{"problem": "1+1", "source": "math"}\n', "'answer'")],
    ids=["empty", "no-answer"],
)
def test_eval_bad_benchmark_file_is_one_line(capsys, tmp_path, content, needle):
    bench = tmp_path / "bench.jsonl"
    bench.write_text(content)
    argv = ["eval", "--model", "tiny:llama", "--benchmarks", str(bench), "--methods", "full"]
    code, err = run_cli([*argv, "--sparsities", "0.5", "--out", str(tmp_path / "out")], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv eval", needle)


def test_eval_out_that_is_a_file_is_one_line(capsys, tmp_path):
    out = tmp_path / "afile"
    out.write_text("keep me")
    argv = ["eval", "--model", "tiny:llama", "--benchmarks", "chain", "--methods", "full", "--out", str(out)]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv eval", "--out", "not a folder")
    assert out.read_text() == "keep me"


def test_usage_errors_are_one_line(capsys):
    code, err = run_cli(["generate", "--model", "tiny:llama"], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv generate", "--prompt")


def test_required_os_sandbox_missing_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no `unshare` here
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "auto")
    sandbox.os_sandbox_available.cache_clear()
    try:
        code, err = run_cli(
            ["--code-sandbox", "namespace", "export-mask", str(tmp_path), "--out", str(tmp_path / "m.json")],
            capsys,
        )
    finally:
        sandbox.os_sandbox_available.cache_clear()
    assert code == 2
    assert_one_error_line(err, "rlkv export-mask", "unshare")


def test_only_the_projects_errors_count_as_user_errors():
    from rlkv.data import ProblemDataError
    from rlkv.head_mask import HeadMaskError
    from rlkv.inference import CompressionConfigError

    for error in (
        UserInputError("x"),
        ProblemDataError("x"),
        HeadMaskError("x"),
        CompressionConfigError("x"),
    ):
        assert is_user_error(error)
    for error in (ValueError("x"), KeyError("x"), RuntimeError("x"), FileNotFoundError("x")):
        assert not is_user_error(error)


def test_train_gates_bad_recipe_is_one_line_not_buried_under_usage(tmp_path, capsys):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model_name_or_path: tiny-missing\nl1_betta: 0.1\n")
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(["--config", str(recipe)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" not in err and len(err.strip().splitlines()) == 1, err
    assert "error: bad recipe" in err and "l1_betta" in err


def test_rlkv_train_is_train_gates_main(tmp_path, capsys):
    """`rlkv train ARGS` runs the same recipe parser as train_gates.py: a bad recipe is one line."""
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("model_name_or_path: tiny-missing\nl1_betta: 0.1\n")
    code, err = run_cli(["train", "--config", str(recipe)], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv train", "bad recipe", "l1_betta")
    assert load_script().main is train_script.main


def test_demo_recipe_on_a_fresh_clone_says_to_build_the_curriculum_first(tmp_path, monkeypatch, capsys):
    """recipes/demo.yaml before `make demo`: one line that says what to run first (issue 16 item 4)."""
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)  # no runs/demo/curriculum here
    argv = [
        "--config",
        str(repo / "recipes" / "demo.yaml"),
        "--model_name_or_path",
        str(repo / "assets" / "demo-model"),
    ]
    with pytest.raises(SystemExit) as exit_info:
        load_script().main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "runs/demo/curriculum" in err and "make demo" in err, err


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["--sample", "--temperature", "-1"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--sparsity", "0.3"], "--head-mask"),
    ],
    ids=["negative-temperature", "negative-temperature-greedy", "top-p", "sparsity-without-mask"],
)
def test_generate_refuses_silently_ignored_settings(capsys, extra, needle):
    code, err = run_cli(
        ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "2", *extra], capsys
    )
    assert code == 2
    assert_one_error_line(err, "rlkv generate", needle)


def test_eval_unknown_source_fails_before_generating(capsys, tmp_path):
    bench = tmp_path / "bench.jsonl"
    bench.write_text('{"problem": "1+1", "answer": "2", "source": "nosuch"}\n')
    argv = [
        "eval",
        "--model",
        "tiny:llama",
        "--benchmarks",
        str(bench),
        "--methods",
        "full",
        "--out",
        str(tmp_path / "o"),
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv eval", "nosuch", "register_verifier")
    assert not (tmp_path / "o" / "results.jsonl").exists()
