"""Hostile inputs (issue 39 item 4): special files, deep or huge JSON, non-UTF-8 text, bad config
values and unwritable outputs each give one clear error (exit status 2 from the CLI), never a
hang, a memory blow-up or a traceback; long commands check `--out` before they work."""

import json
import os
from pathlib import Path

import pytest
import torch
from test_cli_errors import assert_one_error_line, run_cli

from rlkv import HeadMask, HeadMaskError
from rlkv._io import check_output_path, read_text_file
from rlkv.data import ProblemDataError
from rlkv.data.records import read_records
from rlkv.errors import UserInputError
from rlkv.head_mask import ModelFingerprint

FP = ModelFingerprint("m", "llama", 2, 2, 8)


def _mask_doc(**fields) -> dict:
    doc = HeadMask(scores=torch.full((2, 2), 0.5), fingerprint=FP).to_dict()
    doc.update(fields)
    return doc


@pytest.fixture
def fifo(tmp_path) -> Path:
    path = tmp_path / "pipe.json"
    os.mkfifo(path)
    return path


@pytest.fixture
def zero_link(tmp_path) -> Path:
    path = tmp_path / "zero.json"
    path.symlink_to("/dev/zero")
    return path


@pytest.mark.parametrize("special", ["fifo", "zero_link"])
@pytest.mark.parametrize(
    "reader",
    [
        lambda p: HeadMask.load(p),
        lambda p: HeadMask.from_pretrained(p),
        lambda p: HeadMask.from_tsv(p.rename(p.with_suffix(".tsv")), None),
        lambda p: read_records(p),
    ],
    ids=["load", "from_pretrained", "from_tsv", "problems"],
)
def test_special_files_are_refused_without_reading(special, reader, request):
    """A FIFO would hang the read, /dev/zero would read until memory runs out."""
    path = request.getfixturevalue(special)
    with pytest.raises((HeadMaskError, ProblemDataError), match="FIFO|device"):
        reader(path)


def test_size_and_encoding_are_checked(tmp_path):
    big = tmp_path / "big.json"
    big.write_bytes(b" " * 101)
    with pytest.raises(ValueError, match="more than the 100"):
        read_text_file(big, max_bytes=100)
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"a": "caf\xe9"}')
    with pytest.raises(ValueError, match="not UTF-8"):
        read_text_file(latin)


@pytest.mark.parametrize(
    "content, needle",
    [
        ("[" * 200_000 + "]" * 200_000, "RecursionError"),
        (json.dumps(_mask_doc(scores=[[0.5, 10**400], [0.5, 0.5]])), "float32"),
        (json.dumps(_mask_doc(scores=[[True, False], [0.5, 0.5]])), "non-number"),
        (json.dumps(_mask_doc(train_sink=-5)), "train_sink"),
        (json.dumps(_mask_doc(inference_local=1e30)), "inference_local"),
        (json.dumps(_mask_doc(train_local="256")), "train_local"),
        (json.dumps(_mask_doc(metadata=[1, 2])), "metadata"),
    ],
    ids=["deep", "10**400", "bools", "negative-sink", "huge-float-local", "string-local", "list-metadata"],
)
def test_bad_mask_documents_are_head_mask_errors(tmp_path, content, needle):
    path = tmp_path / "head_mask.json"
    path.write_text(content)
    with pytest.raises(HeadMaskError, match=needle):
        HeadMask.load(path)


def test_non_utf8_mask_tsv_and_problems_are_one_error_each(tmp_path):
    for name, read, error in [
        ("head_mask.json", HeadMask.load, HeadMaskError),
        ("mask.tsv", lambda p: HeadMask.from_tsv(p, None), HeadMaskError),
        ("problems.jsonl", read_records, ProblemDataError),
    ]:
        path = tmp_path / name
        path.write_bytes(b"\xff\xfe0.5\t0.5\n")
        with pytest.raises(error, match="not UTF-8"):
            read(path)


def test_generate_with_a_fifo_mask_or_a_non_utf8_prompt_is_one_line(capsys, fifo):
    code, err = run_cli(
        ["generate", "--model", "tiny:llama", "--prompt", "hi", "--head-mask", str(fifo)], capsys
    )
    assert code == 2
    assert_one_error_line(err, "rlkv generate", "FIFO")
    bad_prompt = b"caf\xe9".decode("utf-8", "surrogateescape")  # how Linux hands Python such argv bytes
    code, err = run_cli(["generate", "--model", "tiny:llama", "--prompt", bad_prompt], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv generate", "not UTF-8")


@pytest.mark.parametrize(
    "line, needle",
    [
        ("num_generations: 0", "num_generations"),
        ("max_steps: [1, 2]", "max_steps"),
        ("per_device_train_batch_size: -3", "per_device_train_batch_size"),
        ("learning_rate: .nan", "learning_rate"),
    ],
)
def test_bad_training_counts_are_one_line(tmp_path, capsys, line, needle):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"model_name_or_path: tiny-missing\noutput_dir: {tmp_path / 'run'}\n{line}\n")
    code, err = run_cli(["train", "--config", str(recipe)], capsys)
    assert code == 2
    assert_one_error_line(err, "rlkv train", needle)


def test_rewards_given_as_one_string_is_that_reward():
    from rlkv.trainers.script import ScriptArguments

    assert ScriptArguments(rewards="verify").rewards == ["verify"]
    with pytest.raises(ValueError, match="rewards"):
        ScriptArguments(rewards=[""])


def _unwritable(tmp_path: Path) -> Path:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    return blocker / "out"


@pytest.mark.parametrize(
    "argv, prog",
    [
        (["ablation-mask", "--model", "tiny:llama", "--problems", "{missing}"], "rlkv ablation-mask"),
        (
            [
                "mask-nll",
                "--model",
                "tiny:llama",
                "--problems",
                "{missing}",
                "--random",
                "1",
                "--sparsities",
                "0.5",
            ],
            "rlkv mask-nll",
        ),
        (["eval", "--model", "tiny:llama", "--benchmarks", "{missing}", "--methods", "full"], "rlkv eval"),
        (["data", "curriculum", "--model", "tiny:llama", "--problems", "{missing}"], "rlkv data curriculum"),
    ],
    ids=["ablation-mask", "mask-nll", "eval", "data-curriculum"],
)
def test_unwritable_out_is_refused_before_any_work(tmp_path, capsys, argv, prog):
    """The problems file does not exist either: an error about --out shows the check came first."""
    missing = str(tmp_path / "no-such-problems.jsonl")
    argv = [a.replace("{missing}", missing) for a in argv]
    code, err = run_cli([*argv, "--out", str(_unwritable(tmp_path))], capsys)
    assert code == 2
    assert_one_error_line(err, prog, "a-file")


def test_check_output_path_kinds(tmp_path):
    assert check_output_path(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists(), "the check creates nothing"
    with pytest.raises(UserInputError, match="not a folder"):
        check_output_path(_unwritable(tmp_path), error=UserInputError)
    with pytest.raises(ValueError, match="is a folder"):
        check_output_path(tmp_path, folder=False)
    with pytest.raises(ValueError, match="cannot be written"):
        check_output_path("/proc/rlkv-out")  # a file system that takes no new files, even from root


def test_eval_and_curriculum_readers_refuse_special_and_non_utf8_files(tmp_path, fifo):
    from rlkv.data.curriculum import CurriculumConfig, CurriculumError, _check_or_write_manifest
    from rlkv.eval.config import EvalConfig
    from rlkv.eval.results import KEYS_FILE, current_results, read_results

    with pytest.raises(UserInputError, match="FIFO"):
        read_results(fifo)
    (tmp_path / KEYS_FILE).write_bytes(b'["\xff"]')
    with pytest.raises(UserInputError, match="not UTF-8"):
        current_results(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_bytes(b"model: caf\xe9\n")
    with pytest.raises(UserInputError, match="not UTF-8"):
        EvalConfig.from_yaml(recipe)
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").symlink_to("/dev/zero")
    from datasets import Dataset

    pool = Dataset.from_list(
        [{"problem": "p", "answer": "a", "source": "math", "solution": "", "metadata": "{}"}]
    )
    with pytest.raises(CurriculumError, match="device"):
        _check_or_write_manifest(run, pool, CurriculumConfig(), object())


@pytest.mark.parametrize(
    "field, value",
    [("sink", 10**30), ("window", -1), ("budget", 10**30), ("sink", 1e30), ("min_full_per_layer", True)],
)
def test_compression_sizes_beyond_any_context_are_refused(field, value):
    from rlkv.inference import CompressionConfig
    from rlkv.inference.config import CompressionConfigError

    with pytest.raises(CompressionConfigError, match=field):
        CompressionConfig(**{field: value})
