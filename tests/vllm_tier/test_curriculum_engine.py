"""`rlkv data curriculum --engine vllm` (with and without a head mask) against the transformers engine.

Demo model, fp32, 48 chain problems, greedy, 200 new tokens; the masked form is the eval's (sink 16 + window
64 after a full prompt forward, `vllm_compression`), on both engines.
"""

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.cli import main  # noqa: E402
from rlkv.data.chain_task import load_chain_task  # noqa: E402
from rlkv.data.curriculum import CurriculumConfig, build_curriculum, read_shards  # noqa: E402
from rlkv.inference import load  # noqa: E402
from rlkv.inference.vllm import vllm_compression  # noqa: E402
from rlkv.rollout import TransformersEngine, VLLMEngine  # noqa: E402

CONFIG = CurriculumConfig(buckets="0-100:4,100-200:4", max_new_tokens=200, chunk_size=16, keep="finished")
ENGINE = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "max_model_len": 1024}


def completions(out):
    return {i: (r["completion"], r["finish_reason"]) for i, r in read_shards(out / "shards").items()}


@pytest.mark.parametrize("sparsity", [None, 0.75], ids=["full", "masked"])
def test_vllm_curriculum_records_equal_the_transformers_engines(tmp_path, sparsity):
    model, tokenizer = load(DEMO, dtype="float32")
    pool = load_chain_task("test", 48)
    mask = HeadMask.random(model, seed=0)
    compression = None if sparsity is None else vllm_compression(mask, sparsity)
    build_curriculum(
        TransformersEngine(model, tokenizer, compression=compression, batch_size=16),
        pool,
        tmp_path / "t",
        CONFIG,
    )
    build_curriculum(VLLMEngine(DEMO, compression=compression, **ENGINE), pool, tmp_path / "v", CONFIG)
    reference, served = completions(tmp_path / "t"), completions(tmp_path / "v")
    assert len(served) == len(reference) == 48
    equal = sum(served[i] == reference[i] for i in reference)
    assert equal >= 46, f"{equal} of 48 records equal"
    generator = json.loads((tmp_path / "v" / "run.json").read_text())["generator"]
    assert generator["engine"] == "vllm"
    if sparsity is not None:  # the manifest records the layout, so a resume with another mask is refused
        form = generator["compression"]
        assert "window_prefill" not in form and not form["protect_prompt"]  # the prompt read whole, evictable
        assert (form["sink"], form["window"]) == (16, 64)
        assert generator["compression"]["full_heads"] == mask.full_heads(sparsity).nonzero().tolist()


def test_cli_curriculum_on_vllm_with_a_head_mask(tmp_path, capsys):
    model, _ = load(DEMO, dtype="float32")
    HeadMask.random(model, seed=0).save_pretrained(tmp_path / "mask")
    pool = tmp_path / "pool.jsonl"
    load_chain_task("test", 8).to_json(str(pool))
    args = ["data", "curriculum", "--model", DEMO, "--problems", str(pool), "--engine", "vllm"]
    args += [
        "--head-mask",
        str(tmp_path / "mask"),
        "--sparsity",
        "0.5",
        "--buckets",
        "0-200:4",
        "--keep",
        "all",
    ]
    assert main([*args, "--max-new-tokens", "64", "--dtype", "float32", "--out", str(tmp_path / "cur")]) == 0
    assert len(read_shards(tmp_path / "cur" / "shards")) == 8
    assert "selected" in capsys.readouterr().out
