"""Every documented head-mask form works at every entry point that documents it
(docs/guides/masks.md): a bare L x H_kv `.tsv` of scores, an RLKV-authors file and folder, a DuoAttention folder, a
`save_pretrained` folder and a `head_mask.json`, read by `rlkv eval --head-mask / --ablation-mask /
--duo-mask` (a run and its resume), `rlkv generate --head-mask`, `rlkv mask-nll --masks`,
`CompressionConfig` and compressed rollouts. All forms hold the same scores, so each entry point
must use the same full heads whatever the form."""

import json

import pytest
import torch
from transformers import GenerationConfig

from rlkv import HeadMask
from rlkv.cli import main as cli_main
from rlkv.inference import CompressionConfig, make_cache
from rlkv.rollout import CompressedRolloutConfig
from rlkv.rollout.generation import RolloutGenerator
from rlkv.testing import tiny_model

FORMS = ("scores.tsv", "authors-file", "authors-folder", "duo-folder", "pretrained-folder", "json")


def _tsv(path, scores):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join("\t".join(f"{x:.9f}" for x in row) + "\n" for row in scores.tolist()))
    return path


@pytest.fixture(scope="module")
def masks(tmp_path_factory):
    """{form: path} of one mask of the tiny llama's geometry in every documented form, and the mask."""
    root = tmp_path_factory.mktemp("masks")
    model = tiny_model("llama")
    mask = HeadMask.random(model, seed=3)
    scores = mask.scores
    paths = {
        "scores.tsv": _tsv(root / "scores.tsv", scores),
        "authors-file": _tsv(root / "run" / "adapter_weights.tsv", scores),
        "authors-folder": root / "run",
        "duo-folder": _tsv(root / "duo" / "full_attention_heads.tsv", scores).parent,
        "pretrained-folder": mask.save_pretrained(root / "pretrained"),
        "json": root / "pretrained" / "head_mask.json",
    }
    (root / "duo" / "config.json").write_text(json.dumps({"sink_size": 4, "recent_size": 8}))
    return {form: str(p) for form, p in paths.items()}, mask


@pytest.mark.parametrize("form", FORMS)
def test_eval_reads_every_form_with_every_mask_flag_and_resumes(form, masks, tmp_path, capsys):
    paths, mask = masks
    argv = ["eval", "--model", "tiny:llama", "--benchmarks", "chain", "--sparsities", "0.5"]
    argv += ["--methods", "rlkv,ablation-mask,duo", "--num-problems", "1", "--max-new-tokens", "2"]
    argv += ["--head-mask", paths[form], "--ablation-mask", paths[form], "--duo-mask", paths[form]]
    argv += ["--out", str(tmp_path / "ev"), "--no-progress"]
    assert cli_main(argv) == 0, capsys.readouterr().err
    rows = (tmp_path / "ev" / "results.jsonl").read_text().splitlines()
    assert sorted(json.loads(r)["method"] for r in rows) == ["ablation-mask", "duo", "rlkv"]
    saved = json.loads((tmp_path / "ev" / "eval_config.json").read_text())
    full = " ".join(f"{layer}.{head}" for layer, head in mask.full_heads(0.5).nonzero().tolist())
    for field in ("head_mask", "ablation_mask", "duo_mask"):
        assert saved[f"{field}_layouts"] == {"0.5": full}, field
    assert cli_main(argv) == 0, capsys.readouterr().err  # the resume reads the mask again
    assert (tmp_path / "ev" / "results.jsonl").read_text().splitlines() == rows


@pytest.mark.parametrize("form", FORMS)
def test_generate_compression_config_and_rollouts_read_every_form(form, masks, capsys):
    paths, mask = masks
    model = tiny_model("llama")
    expected = mask.full_heads(0.5)
    argv = ["generate", "--model", "tiny:llama", "--prompt", "hi", "--max-new-tokens", "2", "--json"]
    assert cli_main([*argv, "--head-mask", paths[form], "--sparsity", "0.5"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out.splitlines()[0])["num_generated_tokens"] > 0
    config = CompressionConfig(head_mask=paths[form], sparsity=0.5)
    assert torch.equal(config.full_heads(model), expected)
    assert torch.equal(make_cache(model, config).full_heads, expected)
    rollout = CompressedRolloutConfig(
        head_mask=paths[form], sparsity=0.5, policy="streaming", sink=1, window=2
    )
    generation = GenerationConfig(max_new_tokens=3, do_sample=True, pad_token_id=0, eos_token_id=1)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    batch = RolloutGenerator(rollout, static_cache=False)(
        model, ids, torch.ones_like(ids), generation, temperature=1.0, eos_token_ids=[1]
    )
    assert len(batch.completion_ids) == 2


def test_mask_nll_reads_a_bare_tsv(masks, capsys):
    paths, _ = masks
    argv = ["mask-nll", "--model", "tiny:llama", "--problems", "chain", "--num", "1", "--max-new-tokens", "4"]
    argv += ["--masks", f"scores={paths['scores.tsv']},folder={paths['pretrained-folder']}"]
    assert cli_main([*argv, "--sparsities", "0.5", "--no-progress"]) == 0, capsys.readouterr().err
    printed = capsys.readouterr().out
    lines = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.split()}
    assert lines["scores"] == lines["folder"]  # same scores, same heads, same NLL increase
