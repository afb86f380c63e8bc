"""Head masks as shared artifacts: save_pretrained / from_pretrained, the RLKV authors' and
DuoAttention layouts, checks without weights (a config or a meta-device model), and every entry
point (CompressionConfig, `rlkv generate`, `rlkv eval`, rollouts) reading the same things."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlkv import HeadMask, HeadMaskError
from rlkv.cli import main as cli_main
from rlkv.inference import CompressionConfig, make_cache
from rlkv.testing import tiny_model

# the geometry of DeepSeek-R1-Distill-Llama-8B (Llama-3.1-8B): 32 layers x 8 KV heads x 128
LLAMA_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
)


def _authors_tsv(path, layers, heads, seed=0):
    """A file in the RLKV authors' layout: L rows x H_kv gates in %.18e, a few slightly below 0."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(layers, heads, generator=g)
    scores[0, 1] = -3.54e-3
    scores[layers - 1, 0] = -5.4e-4
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(f"{x:.18e}" for x in row) + "\n" for row in scores.tolist()))
    return scores


@pytest.fixture
def model():
    return tiny_model("llama", num_hidden_layers=3, num_key_value_heads=2)


def test_save_pretrained_writes_json_tsv_and_card_and_round_trips(model, tmp_path):
    mask = HeadMask.random(model, seed=1)
    folder = mask.save_pretrained(tmp_path / "mask")
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "head_mask.json", "head_mask.tsv"]
    card = (folder / "README.md").read_text()
    assert "rlkv" in card and "3 layers x 2 KV heads" in card and "HeadMask.from_pretrained" in card
    assert f"s=0.875: {mask.num_full_heads(0.875)} full" in card  # the eval grid's highest sparsity
    back = HeadMask.from_pretrained(folder, model)
    assert torch.equal(back.scores, mask.scores) and back.fingerprint == mask.fingerprint
    assert HeadMask.from_pretrained(folder).to_dict() == mask.to_dict()  # JSON needs no model
    assert len((folder / "head_mask.tsv").read_text().splitlines()) == 3
    assert not list(folder.glob(".*tmp"))


def test_from_pretrained_checks_the_model_it_is_given(model, tmp_path):
    folder = HeadMask.random(model).save_pretrained(tmp_path / "mask")
    other = tiny_model("llama", num_hidden_layers=2, num_key_value_heads=2)
    with pytest.raises(HeadMaskError, match="num_hidden_layers: mask has 3, model has 2"):
        HeadMask.from_pretrained(folder, other)


def test_rlkv_authors_folder_and_file(model, tmp_path):
    run = tmp_path / "head_dist" / "rlkv" / "Tiny" / "llama_lr1e-2_ep2_bs32_reg1e-3_tau0.5"
    raw = _authors_tsv(run / "adapter_weights.tsv", 3, 2)
    for source in (run, run / "adapter_weights.tsv"):
        mask = HeadMask.from_pretrained(source, model)
        assert torch.equal(mask.scores, raw.clamp(0, 1))  # gates slightly below 0 become 0
        assert mask.metadata["format"] == "rlkv-authors"
        assert mask.fingerprint.num_hidden_layers == 3
    with pytest.raises(HeadMaskError, match="shape \\(3, 2\\) does not match .* \\(2, 2\\)"):
        HeadMask.from_pretrained(run, tiny_model("llama", num_hidden_layers=2, num_key_value_heads=2))


def test_duo_attention_folder_takes_sink_and_recent_from_its_config(model, tmp_path):
    run = tmp_path / "attn_patterns" / "Tiny" / "lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10"
    raw = _authors_tsv(run / "full_attention_heads.tsv", 3, 2)
    (run / "config.json").write_text(json.dumps({"sink_size": 64, "recent_size": 192, "lr": 0.02}))
    mask = HeadMask.from_pretrained(run, model)
    assert torch.equal(mask.scores, raw.clamp(0, 1))
    assert (mask.train_sink, mask.train_local) == (64, 192)
    assert mask.metadata["format"] == "duo-attention" and mask.metadata["lr"] == 0.02
    (run / "config.json").write_text(json.dumps({"recent_size": 192}))
    with pytest.raises(HeadMaskError, match="config.json.*'sink_size'"):
        HeadMask.from_pretrained(run, model)
    (run / "config.json").unlink()
    with pytest.raises(HeadMaskError, match="config.json"):
        HeadMask.from_pretrained(run, model)


def test_tsv_without_a_model_and_unknown_folders_fail_clearly(model, tmp_path):
    _authors_tsv(tmp_path / "a" / "adapter_weights.tsv", 3, 2)
    with pytest.raises(HeadMaskError, match="pass the model .*or its config"):
        HeadMask.from_pretrained(tmp_path / "a")
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        HeadMaskError, match="head_mask.json, adapter_weights.tsv or full_attention_heads.tsv"
    ):
        HeadMask.from_pretrained(tmp_path / "empty", model)
    with pytest.raises(HeadMaskError, match="no such head-mask file or folder"):
        HeadMask.from_pretrained(tmp_path / "missing.json", model)


def test_subfolder_of_a_local_folder(model, tmp_path):
    HeadMask.random(model, seed=2).save_pretrained(tmp_path / "repo" / "s0.5")
    mask = HeadMask.from_pretrained(tmp_path / "repo", model, subfolder="s0.5")
    assert torch.equal(mask.scores, HeadMask.random(model, seed=2).scores)


def test_hub_id_reads_the_huggingface_cache_offline(model, tmp_path):
    # the hub cache layout huggingface_hub itself reads: refs/<revision> -> snapshots/<commit>/
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--someone--tiny-mask"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    HeadMask.random(model, seed=4).save_pretrained(repo / "snapshots" / commit / "masks")
    mask = HeadMask.from_pretrained(
        "someone/tiny-mask", model, subfolder="masks", cache_dir=tmp_path / "cache", local_files_only=True
    )
    assert torch.equal(mask.scores, HeadMask.random(model, seed=4).scores)
    with pytest.raises(HeadMaskError, match="someone/other-mask.*Hugging Face Hub"):
        HeadMask.from_pretrained(
            "someone/other-mask", model, cache_dir=tmp_path / "cache", local_files_only=True
        )


def test_an_8b_mask_is_checked_against_a_config_and_a_meta_model_without_weights(tmp_path):
    config = LlamaConfig(**LLAMA_8B)
    _authors_tsv(tmp_path / "r1" / "adapter_weights.tsv", 32, 8)
    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(config)
    assert next(meta_model.parameters()).is_meta
    for target in (config, meta_model):
        mask = HeadMask.from_pretrained(tmp_path / "r1", target)
        mask.check_compatible(target)
        assert mask.fingerprint.head_dim == 128 and int(mask.full_heads(0.5).sum()) == 128
    with pytest.raises(HeadMaskError, match="num_key_value_heads: mask has 8, model has 4"):
        mask.check_compatible(LlamaConfig(**{**LLAMA_8B, "num_key_value_heads": 4}))
    assert CompressionConfig(head_mask=tmp_path / "r1", sparsity=0.25).full_heads(meta_model).sum() == 192


def test_compression_config_and_cache_accept_every_layout(model, tmp_path):
    _authors_tsv(tmp_path / "run" / "adapter_weights.tsv", 3, 2)
    HeadMask.from_pretrained(tmp_path / "run", model).save_pretrained(tmp_path / "pretrained")
    expected = HeadMask.from_pretrained(tmp_path / "run", model).full_heads(0.5)
    for source in ("run", "run/adapter_weights.tsv", "pretrained", "pretrained/head_mask.json"):
        config = CompressionConfig(head_mask=str(tmp_path / source), sparsity=0.5)
        assert torch.equal(config.full_heads(model), expected)
        cache = make_cache(model, config)
        assert torch.equal(cache.full_heads, expected)


def test_cli_generate_and_eval_accept_the_tsv_and_folders(tmp_path, capsys):
    model = tiny_model("llama")
    _authors_tsv(tmp_path / "run" / "adapter_weights.tsv", 2, 2)
    base = ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "3", "--json"]
    for source in ("run/adapter_weights.tsv", "run"):
        assert cli_main([*base, "--head-mask", str(tmp_path / source)]) == 0, capsys.readouterr().err
        assert json.loads(capsys.readouterr().out.splitlines()[0])["num_generated_tokens"] > 0
    HeadMask.random(model).save_pretrained(tmp_path / "pre")
    argv = ["eval", "--model", "tiny:llama", "--head-mask", str(tmp_path / "pre"), "--benchmarks", "chain"]
    argv += ["--methods", "rlkv", "--sparsities", "0.5", "--num-problems", "1", "--max-new-tokens", "2"]
    assert cli_main([*argv, "--out", str(tmp_path / "ev"), "--no-progress"]) == 0
    assert (tmp_path / "ev" / "results.jsonl").read_text().count("\n") == 1
