"""`rlkv serve` / `rlkv export-vllm` before vLLM starts: a user's --hf-overrides merged (never dropping the
split), no source file deleted or shared, every refusal one line. No vLLM needed: each check runs before
the command looks for vLLM (the vLLM tier, tests/vllm_tier/test_serve.py, runs the server itself)."""

import importlib.util
import json
import socket

import pytest
from test_cli_errors import assert_one_error_line, run_cli

from rlkv import HeadMask
from rlkv.cli.vllm_args import option, take_hf_overrides
from rlkv.inference import load
from rlkv.testing import tiny_config

DEMO = "assets/demo-model"


@pytest.fixture(scope="module")
def mask_dir(tmp_path_factory):
    model, _ = load(DEMO, dtype="float32")
    folder = tmp_path_factory.mktemp("mask")
    HeadMask.random(model, seed=0).save_pretrained(folder)
    return str(folder)


def test_every_form_of_hf_overrides_is_taken_out_and_merged_as_vllm_parses_it():
    args = [
        "--port",
        "9",
        "--hf-overrides",
        '{"max_position_embeddings": 2048, "rope_parameters": {"rope_theta": 10}}',
        "--hf_overrides.rope_parameters.factor=2.0",
        "--hf-overrides.name",
        "plain text",
        "--dtype=float32",
    ]
    overrides, rest = take_hf_overrides(args)
    assert overrides == {
        "max_position_embeddings": 2048,
        "rope_parameters": {"rope_theta": 10, "factor": 2.0},
        "name": "plain text",
    }
    assert rest == ["--port", "9", "--dtype=float32"]
    assert option(rest, "--port") == "9" and option(rest, "--dtype") == "float32"
    assert option(["-tp", "2"], "--tensor-parallel-size", "-tp") == "2"


def _serve(mask_dir, *extra):
    return ["serve", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5", *extra]


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ('{"architectures": ["LlamaForCausalLM"]}', "architectures"),
        ('{"rlkv_head_split": {}}', "rlkv_head_split"),
        ('{"num_key_value_heads": 4}', "num_key_value_heads"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_overrides_that_touch_the_split_are_refused_in_one_line(capsys, mask_dir, overrides, needle):
    code, err = run_cli(_serve(mask_dir, "--hf-overrides", overrides, "--port", str(_free_port())), capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", needle)


def test_prefix_caching_is_turned_off_for_a_token_eviction_policy_and_refused_when_asked(capsys, mask_dir):
    from rlkv.cli.serve import _prefix_caching_flags

    rkv = {"window": 8, "sink": 16, "policy": "rkv", "budget": 80}
    assert _prefix_caching_flags(rkv, ["--port", "9"]) == ["--port", "9", "--no-enable-prefix-caching"]
    assert _prefix_caching_flags(rkv, ["--no_enable_prefix_caching"]) == ["--no_enable_prefix_caching"]
    assert _prefix_caching_flags({"window": 64, "sink": 16}, ["--port", "9"]) == ["--port", "9"]  # streaming
    argv = _serve(mask_dir, "--policy", "rkv", "--budget", "80", "--enable-prefix-caching")
    code, err = run_cli([*argv, "--port", str(_free_port())], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", "--enable-prefix-caching with --policy rkv", "drop the flag")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_in_use_is_refused_before_vllm_starts(capsys, mask_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_cli(_serve(mask_dir, "--host", "127.0.0.1", "--port", str(port)), capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", f"--port {port}", "pick a free port")


@pytest.mark.parametrize(
    "flag, needles",
    [
        (["--pipeline-parallel-size=2"], ("pipeline-parallel-size", "tensor parallelism only")),
        (["-pp", "2"], ("pipeline-parallel-size", "tensor-parallel-size instead")),
        # the demo model has 2 KV heads per layer: 3 ranks cannot share them
        (["--tensor-parallel-size", "3"], ("tensor_parallel_size=3", "do not divide")),
        (["-tp=0"], ("--tensor-parallel-size '0'", "positive integer")),
    ],
)
def test_parallelism_the_split_cannot_serve_is_one_line_before_vllm_starts(capsys, mask_dir, flag, needles):
    code, err = run_cli(_serve(mask_dir, *flag, "--port", str(_free_port())), capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", *needles)


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None,
    reason="with vLLM installed the command would start the server",
)
def test_a_balanced_cut_that_changes_the_sparsity_is_reported(capsys, mask_dir):
    """Demo model, 8 KV heads in 4 layers of 2: s=0.4 asks for 5 full heads, 2 ranks need whole layers (4)."""
    argv = ["serve", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.4", "-tp", "2"]
    _, err = run_cli([*argv, "--port", str(_free_port())], capsys)
    assert "cut balanced for 2 ranks" in err and "serving sparsity 0.5, asked 0.4" in err, err


@pytest.mark.parametrize("command", ["serve", "export-vllm"])
def test_a_model_that_does_not_exist_is_one_line(capsys, mask_dir, tmp_path, command):
    argv = [command, "--model", str(tmp_path / "missing"), "--head-mask", mask_dir, "--sparsity", "0.5"]
    argv += ["--out", str(tmp_path / "out")] if command == "export-vllm" else ["--port", str(_free_port())]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, f"rlkv {command}", "missing", "--model")


def test_a_model_with_its_own_sliding_window_layers_is_refused_before_vllm_starts(capsys, mask_dir, tmp_path):
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=32, max_window_layers=0)
    config.save_pretrained(tmp_path / "qwen2-swa")
    argv = ["serve", "--model", str(tmp_path / "qwen2-swa"), "--head-mask", mask_dir, "--sparsity", "0.5"]
    code, err = run_cli([*argv, "--port", str(_free_port())], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", "sliding_window=32", "use_sliding_window")
    out = ["--out", str(tmp_path / "out")]
    code, err = run_cli(["export-vllm", *argv[1:], *out], capsys)  # every path to an engine: the same line
    assert code == 2
    assert_one_error_line(err, "rlkv export-vllm", "sliding_window=32")


def _snapshot(folder):
    return {p.name: (p.read_bytes(), p.stat().st_ino) for p in sorted(folder.iterdir())}


def test_export_never_writes_into_the_model_folder(capsys, mask_dir, tmp_path):
    import shutil
    from pathlib import Path

    model = tmp_path / "model"
    shutil.copytree(DEMO, model)
    before = _snapshot(model)
    for out in (model, model / "sub", tmp_path):
        code, err = run_cli(
            [
                "export-vllm",
                "--model",
                str(model),
                "--head-mask",
                mask_dir,
                "--sparsity",
                "0.5",
                "--out",
                str(out),
            ]
            + ["--overwrite"],
            capsys,
        )
        assert code == 2
        assert_one_error_line(err, "rlkv export-vllm", "model folder")
    assert _snapshot(model) == before
    assert not Path(model / "sub").exists()


def test_export_copies_small_files_and_replaces_a_folder_only_when_asked(capsys, mask_dir, tmp_path):
    out = tmp_path / "served"
    argv = ["export-vllm", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5", "--out", str(out)]
    assert run_cli(argv, capsys)[0] == 0
    (out / "generation_config.json").write_text("{}")  # editing the export ...
    from pathlib import Path

    assert json.loads(Path(DEMO, "generation_config.json").read_text())  # ... leaves the model's as it was
    assert (out / "model.safetensors").stat().st_ino == Path(DEMO, "model.safetensors").stat().st_ino
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv export-vllm", "not empty", "--overwrite")
    assert (out / "generation_config.json").read_text() == "{}"  # the refused run changed nothing
    assert run_cli([*argv, "--overwrite"], capsys)[0] == 0
    assert json.loads((out / "generation_config.json").read_text())  # replaced whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["served"]  # no staging or old folder left


def test_export_to_an_unwritable_place_is_one_line(capsys, mask_dir):
    argv = [
        "export-vllm",
        "--model",
        DEMO,
        "--head-mask",
        mask_dir,
        "--sparsity",
        "0.5",
        "--out",
        "/proc/rlkv",
    ]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv export-vllm", "--out", "cannot be written")


def test_a_window_that_covers_every_position_is_noted(capsys, mask_dir, tmp_path):
    argv = ["export-vllm", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5"]
    code, err = run_cli([*argv, "--out", str(tmp_path / "o"), "--window", "100000"], capsys)
    assert code == 0
    assert "cover all 1024 positions" in err and "nothing is compressed" in err


def test_export_writes_the_form_asked_for(capsys, mask_dir, tmp_path):
    base = ["export-vllm", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5"]
    forms = {
        "eval": ([], {"sink": 16, "window": 64, "prompt": "full"}),
        "protected": (["--protect-prompt"], {"sink": 16, "window": 64, "prompt": "protected"}),
        "window-only": (["--sink", "0", "--window-prefill"], {"sink": 0, "window": 64, "prompt": "window"}),
    }
    for name, (flags, want) in forms.items():
        assert run_cli([*base, *flags, "--out", str(tmp_path / name)], capsys)[0] == 0
        split = json.loads((tmp_path / name / "config.json").read_text())["rlkv_head_split"]
        assert {k: split[k] for k in want} == want
    code, err = run_cli([*base, "--protect-prompt", "--window-prefill", "--out", str(tmp_path / "x")], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv export-vllm", "protect_prompt=True with window_prefill=True")


def test_export_writes_a_token_eviction_policy_and_refuses_what_vllm_cannot_run(capsys, mask_dir, tmp_path):
    base = ["export-vllm", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5", "--window", "8"]
    flags = ["--policy", "rkv", "--budget", "80", "--policy-kwargs", '{"buffer": 0}']
    assert run_cli([*base, *flags, "--out", str(tmp_path / "rkv")], capsys)[0] == 0
    split = json.loads((tmp_path / "rkv" / "config.json").read_text())["rlkv_head_split"]
    assert (
        split["policy"] == {"name": "rkv", "budget": 80, "kwargs": {"buffer": 0}}
        and split["prompt"] == "full"
    )
    assert (
        run_cli([*base, "--policy", "random", "--budget", "0.25", "--out", str(tmp_path / "r")], capsys)[0]
        == 0
    )
    split = json.loads((tmp_path / "r" / "config.json").read_text())["rlkv_head_split"]
    assert split["policy"] == {"name": "random", "budget": 0.25, "kwargs": {}}
    refused = {
        ("--policy", "rpc", "--budget", "80"): "--policy rpc: vLLM serves",
        ("--policy", "rkv", "--budget", "lots"): "--budget 'lots'",
        ("--policy", "rkv", "--policy-kwargs", "{buffer: 0}"): "--policy-kwargs",
        ("--budget", "80"): "--budget without --policy",
        ("--policy", "rkv", "--budget", "80", "--window-prefill"): "window_prefill=True",
    }
    for extra, needle in refused.items():
        code, err = run_cli([*base, *extra, "--out", str(tmp_path / "x")], capsys)
        assert code == 2, extra
        assert_one_error_line(err, "rlkv export-vllm", needle)
    assert not (tmp_path / "x").exists()


RKV80 = ["--policy", "rkv", "--budget", "80"]


@pytest.mark.parametrize("command", ["serve", "export-vllm"])
@pytest.mark.parametrize(
    "flags, needles",
    [
        ([*RKV80, "--policy-kwargs", '{"bogus": 1}'], ("--policy-kwargs", "no field 'bogus'")),
        ([*RKV80, "--policy-kwargs", '{"lam": "x"}'], ("--policy-kwargs", "lam='x' must be a number")),
        ([*RKV80, "--policy-kwargs", '{"buffer": 1.5}'], ("buffer=1.5 must be an integer",)),
        ([*RKV80, "--policy-kwargs", '{"lam": 2}'], ("lam=2 must be in [0, 1]",)),
        (["--policy", "snapkv", "--policy-kwargs", '{"pooling": "sum"}'], ("pooling='sum' must be one of",)),
        (["--policy-kwargs", '{"buffer": 0}'], ("--policy-kwargs without --policy",)),
        (
            ["--policy", "skipkv", "--budget", "80"],
            ("--policy skipkv", "transformers engine only", "rlkv generate"),
        ),
        (["--policy", "bogus"], ("--policy bogus: no such policy",)),
        (["--policy", "rkv", "--budget", "0", "--sink", "0", "--window", "0"], ("--budget 0", "at least 1")),
        (["--policy", "rkv", "--budget", "40"], ("--budget 40", "at least 80")),
        (["--policy", "rkv", "--budget", "1.5"], ("--budget 1.5", "(0, 1]")),
    ],
)
def test_policy_fields_are_checked_before_vllm_starts(capsys, mask_dir, tmp_path, command, flags, needles):
    """Every --policy / --budget / --policy-kwargs mistake is one line in the CLI's flags, before vLLM loads
    (and before export writes a folder that would fail only when served)."""
    argv = [command, "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5", *flags]
    argv += ["--out", str(tmp_path / "x")] if command == "export-vllm" else ["--port", str(_free_port())]
    code, err = run_cli(argv, capsys)
    assert code == 2
    assert_one_error_line(err, f"rlkv {command}", *needles)
    assert not (tmp_path / "x").exists()


def test_policy_kwargs_are_checked_in_python_too():
    """`vllm_overrides` (and so the eval and the rollouts) refuse the same kwargs before an engine starts."""
    from rlkv.inference.config import CompressionConfigError
    from rlkv.inference.vllm import vllm_overrides
    from rlkv.policies import PolicyArgumentError, get_policy

    mask = HeadMask.random(load(DEMO, dtype="float32")[0], seed=0)
    with pytest.raises(CompressionConfigError, match="no field 'bogus'"):
        vllm_overrides(DEMO, mask, 0.5, policy="rkv", budget=80, policy_kwargs={"bogus": 1})
    with pytest.raises(PolicyArgumentError, match="buffer=1.5 must be an integer"):
        get_policy("rkv", buffer=1.5)
    assert get_policy("rkv", buffer=2.0).buffer == 2  # a whole float (JSON 2.0) is the integer


def test_a_budget_over_every_position_is_noted(capsys, mask_dir, tmp_path):
    argv = ["export-vllm", "--model", DEMO, "--head-mask", mask_dir, "--sparsity", "0.5", "--policy", "rkv"]
    code, err = run_cli([*argv, "--budget", "5000", "--out", str(tmp_path / "o")], capsys)
    assert code == 0
    assert "--budget 5000 covers all 1024 positions" in err and "never evicts" in err


def test_prefix_caching_given_as_a_value_is_read_and_refused_with_a_policy(capsys, mask_dir):
    from rlkv.cli.vllm_args import switch

    assert switch(["--enable-prefix-caching=true"], "enable-prefix-caching") is True
    assert switch(["--enable_prefix_caching=False"], "enable-prefix-caching") is False
    argv = _serve(mask_dir, "--policy", "rkv", "--budget", "80", "--enable-prefix-caching=true")
    code, err = run_cli([*argv, "--port", str(_free_port())], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv serve", "--enable-prefix-caching with --policy rkv")
