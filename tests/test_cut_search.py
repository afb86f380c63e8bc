"""`eliminate` (`rlkv search-mask`): block-greedy backward elimination on the joint NLL of a head set."""

from __future__ import annotations

import json

import pytest
import torch

from rlkv.ablation import ablation_scores, greedy_solutions, mask_from_scores, mask_nll
from rlkv.cli import main as cli_main
from rlkv.cut_search import eliminate
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model, tiny_tokenizer

PROBLEMS = [{"problem": f"{a} + {b} =", "answer": str(a + b)} for a, b in [(3, 4), (12, 9), (7, 7), (20, 5)]]
SETTINGS = dict(sink=2, local=4, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def scored_model():
    """A tiny Qwen2 (4 layers x 2 KV heads), its greedy solutions and its ablation mask."""
    model = tiny_model("qwen2", num_hidden_layers=4)
    sequences = greedy_solutions(model, tiny_tokenizer(), PROBLEMS, 12, template="plain", progress=False)
    mask = mask_from_scores(ablation_scores(model, sequences, **SETTINGS), model)
    return model, sequences, mask


def _flat(full: torch.Tensor) -> list[int]:
    return sorted(full.flatten().nonzero().flatten().tolist())


def test_each_round_compresses_the_cheapest_heads_and_the_ranking_serves_every_round(scored_model):
    model, sequences, mask = scored_model
    searched, rounds = eliminate(model, sequences, mask, start=0.25, stop=0.75, block=2, **SETTINGS)
    start = _flat(mask.full_heads(0.25))
    assert [len(r.full) for r in rounds] == [4, 2]  # 6 full heads at the start, 2 removed per round
    # round 1 against costs measured apart (mask_nll of each one-head removal from the start set)
    masks = {}
    for h in start:
        order = [[i // 2, i % 2] for i in range(8) if i not in start] + [[h // 2, h % 2]]
        order += [[i // 2, i % 2] for i in start if i != h]
        masks[h] = HeadMask.from_order(torch.tensor(order), model)
    _, alone = mask_nll(model, sequences, masks, [3 / 8], **SETTINGS)
    cheapest = sorted(start, key=lambda h: alone[h][3 / 8])[:2]
    assert sorted(rounds[0].removed) == sorted(cheapest)
    assert rounds[0].removal_increases == pytest.approx(sorted(alone[h][3 / 8] for h in cheapest), abs=1e-6)
    # the searched mask keeps each round's set at its sparsity, and its NLL there is the one recorded
    for r in rounds:
        s = 1 - len(r.full) / 8
        assert _flat(searched.full_heads(s)) == r.full
        _, increase = mask_nll(model, sequences, {"searched": searched}, [s], **SETTINGS)
        assert increase["searched"][s] == pytest.approx(r.increase, abs=1e-6)
    assert set(rounds[1].full) <= set(rounds[0].full) <= set(start)  # nested
    assert searched.metadata["elimination"]["rounds"][1]["full"] == rounds[1].full
    assert not hasattr(model, "rlkv_gates")


def test_a_stopped_search_resumes_from_its_scores_and_shards_keep_whole_groups(scored_model):
    model, sequences, mask = scored_model
    scored, calls = {}, []
    first, _ = eliminate(model, sequences, mask, start=0.25, stop=0.75, scored=scored, **SETTINGS)
    again, _ = eliminate(
        model, sequences, mask, start=0.25, stop=0.75, scored=scored, on_score=calls.append, **SETTINGS
    )
    assert calls == [] and torch.equal(first.scores, again.scores)
    balanced, rounds = eliminate(model, sequences, mask, start=0.5, stop=0.75, shards=2, **SETTINGS)
    assert [len(r.full) for r in rounds] == [2]
    for s in (
        0.5,
        0.75,
    ):  # every layer keeps 0 or 2 full heads; the TP cut of the ranking is the search's set
        full = balanced.full_heads(s, shards=2)
        assert set(full.sum(dim=1).tolist()) <= {0, 2}
    assert _flat(balanced.full_heads(0.75, shards=2)) == rounds[0].full


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(start=0.75, stop=0.5), "start"), (dict(block=0), "block"), (dict(shards=3), "shards")],
)
def test_bad_settings_raise_naming_the_setting(scored_model, kwargs, field):
    model, sequences, mask = scored_model
    with pytest.raises(ValueError, match=field):
        eliminate(model, sequences, mask, **(SETTINGS | kwargs))


def test_search_mask_cli_writes_the_mask_and_prints_each_round(tmp_path, capsys):
    start = tmp_path / "ablation"
    common = ["--model", "tiny:qwen2", "--problems", "chain", "--num", "4", "--max-new-tokens", "8"]
    common += ["--sink", "2", "--local", "4", "--no-progress"]
    assert cli_main(["ablation-mask", *common, "--out", str(start)]) == 0
    out = tmp_path / "searched"
    argv = [
        "search-mask",
        "--mask",
        str(start),
        *common,
        "--start",
        "0.5",
        "--stop",
        "0.75",
        "--out",
        str(out),
    ]
    assert cli_main(argv) == 0
    printed = capsys.readouterr().out
    meta = json.loads((out / "head_mask.json").read_text())["metadata"]["elimination"]
    assert meta["problem_set"] == "chain" and meta["seconds"] > 0 and meta["rounds"]
    assert "round 1:" in printed and f"wrote {out}" in printed
    assert not (tmp_path / "searched.partial.json").exists()  # removed once the search is written
