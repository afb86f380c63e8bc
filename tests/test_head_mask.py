"""The head-mask artifact: round trips, top-k selection, model binding and malformed input."""

import json

import pytest
import torch

import rlkv
from rlkv import HeadMask, HeadMaskError
from rlkv.head_mask import TIE_BREAK_BELOW_ZERO, ModelFingerprint
from rlkv.testing import tiny_model


@pytest.fixture
def mask():
    model = tiny_model("llama", num_hidden_layers=3, num_key_value_heads=2)
    gates = rlkv.attach_gates(model)
    gates.alpha.data = torch.tensor([[0.9, 0.1], [0.5, 0.5], [1.3, -0.2]])  # out-of-range values get clamped
    return HeadMask.from_gates(gates, model, steps=10, beta=1e-3), model


def test_from_gates_records_clamped_scores_and_fingerprint(mask):
    m, model = mask
    assert torch.equal(m.scores, torch.tensor([[0.9, 0.1], [0.5, 0.5], [1.0, 0.0]]))
    assert m.fingerprint.num_hidden_layers == 3 and m.fingerprint.num_key_value_heads == 2
    assert m.fingerprint.head_dim == 16 and m.fingerprint.model_type == "llama"
    assert (m.train_sink, m.train_local, m.inference_sink, m.inference_local) == (128, 256, 16, 64)
    assert m.metadata == {"tie_break": TIE_BREAK_BELOW_ZERO, "steps": 10, "beta": 1e-3}
    assert torch.equal(m.tie_break, torch.zeros(3, 2))  # the gates were never clamped from below 0


def test_json_round_trip(mask, tmp_path):
    m, model = mask
    path = m.save(tmp_path / "sub" / "head_mask.json")
    back = HeadMask.load(path)
    assert torch.equal(back.scores, m.scores) and back.fingerprint == m.fingerprint
    assert back.metadata == m.metadata and back.to_dict() == m.to_dict()
    assert not list((tmp_path / "sub").glob(".*tmp"))  # atomic write leaves no temp file
    back.check_compatible(model)


def test_tsv_round_trip(mask, tmp_path):
    m, model = mask
    m.to_tsv(tmp_path / "gates.tsv")
    lines = (tmp_path / "gates.tsv").read_text().splitlines()
    assert len(lines) == 3 and all(len(line.split("\t")) == 2 for line in lines)
    back = HeadMask.from_tsv(tmp_path / "gates.tsv", model)
    assert torch.equal(back.scores, m.scores)


@pytest.mark.parametrize("sparsity,count", [(0.0, 6), (0.5, 3), (0.7, 2), (1.0, 0), (0.25, 4)])
def test_full_heads_keeps_exact_top_k(mask, sparsity, count):
    m, _ = mask
    full = m.full_heads(sparsity)
    assert full.dtype == torch.bool and full.shape == (3, 2)
    assert int(full.sum()) == count == round((1 - sparsity) * 6)
    kept, dropped = m.scores[full], m.scores[~full]
    if len(kept) and len(dropped):
        assert kept.min() >= dropped.max()


def test_ties_break_deterministically_towards_lower_index(mask):
    m, _ = mask
    # scores 0.5 at (1,0) and (1,1): one slot left after 1.0 and 0.9 -> (1,0) wins
    assert m.full_heads(0.5).tolist() == [[True, False], [True, False], [True, False]]


def _tied_mask(model, tie_break=None):
    # four heads at 0.0 (clamped gates), two above: every cut below the top two falls among ties
    scores = torch.tensor([[0.0, 0.7], [0.0, 0.0], [0.9, 0.0]])
    return HeadMask(scores=scores, fingerprint=ModelFingerprint.of(model), tie_break=tie_break)


def test_tie_break_ranks_heads_with_equal_scores(mask):
    _, model = mask
    tie_break = torch.tensor([[-3.0, 0.0], [-0.5, -2.0], [0.0, -1.0]])
    m = _tied_mask(model, tie_break)
    # after (2,0) and (0,1), the zero-score heads in tie-break order: (1,0) -0.5, (2,1) -1, (1,1) -2, (0,0) -3
    assert m.full_heads(0.5).tolist() == [[False, True], [True, False], [True, False]]
    assert m.full_heads(1 / 6).tolist() == [[False, True], [True, True], [True, True]]
    assert m.order().tolist() == [[0, 0], [1, 1], [2, 1], [1, 0], [0, 1], [2, 0]]
    assert m.index_decided_ties() == 0
    # without it the same cut is decided by index (the lower (layer, head) first)
    plain = _tied_mask(model)
    assert plain.full_heads(0.5).tolist() == [[True, True], [False, False], [True, False]]
    assert plain.index_decided_ties() == 3


def test_order_and_full_heads_agree(mask):
    _, model = mask
    for m in (_tied_mask(model), _tied_mask(model, torch.tensor([[1.0, 0.0], [2.0, 3.0], [0.0, 4.0]]))):
        order = m.order().tolist()
        for k in range(7):
            full = m.full_heads(1 - k / 6)
            assert sorted(map(tuple, full.nonzero().tolist())) == sorted(map(tuple, order[6 - k :]))


def test_tie_break_round_trips_and_is_validated(mask, tmp_path):
    _, model = mask
    m = _tied_mask(model, torch.tensor([[-3.0, 0.0], [-0.5, -2.0], [0.0, -1.0]]))
    back = HeadMask.load(m.save(tmp_path / "m.json"))
    assert torch.equal(back.tie_break, m.tie_break) and back.to_dict() == m.to_dict()
    assert HeadMask.load(_tied_mask(model).save(tmp_path / "plain.json")).tie_break is None
    doc = m.to_dict()
    for bad, match in [
        ([[1.0, 2.0]], "tie_break"),
        ([[True, 0.0], [0.0, 0.0], [0.0, 0.0]], "non-number"),
        ([[float("nan"), 0.0], [0.0, 0.0], [0.0, 0.0]], "non-finite"),
        ("high", "list of L lists"),
    ]:
        with pytest.raises(HeadMaskError, match=match):
            HeadMask.from_dict({**doc, "tie_break": bad})


def test_min_full_per_layer_reserves_heads(mask):
    m, _ = mask
    full = m.full_heads(0.5, min_full_per_layer=1)
    assert full.sum(1).min() >= 1 and int(full.sum()) == 3


def test_order_is_least_important_first(mask):
    m, _ = mask
    order = m.order().tolist()
    assert order[0] == [2, 1] and order[-1] == [2, 0]


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"num_hidden_layers": 2}, "num_hidden_layers: mask has 3, model has 2"),
        ({"num_key_value_heads": 4}, "num_key_value_heads: mask has 2, model has 4"),
        ({"head_dim": 8}, "head_dim: mask has 16, model has 8"),
    ],
)
def test_mask_from_another_model_is_refused(mask, overrides, match):
    m, _ = mask
    config = dict(num_hidden_layers=3, num_key_value_heads=2)
    config.update(overrides)
    other = tiny_model("llama", **config)
    with pytest.raises(HeadMaskError, match=match):
        m.check_compatible(other)


def _write(tmp_path, doc):
    path = tmp_path / "m.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: "{not json", "not valid JSON"),
        (lambda d: {**d, "format": "other"}, "field 'format'"),
        (lambda d: {**d, "format_version": 99}, "unknown format_version 99"),
        (lambda d: {**d, "scores": [[0.1, 0.2]]}, "shape"),
        (lambda d: {**d, "scores": [[0.1], [0.2, 0.3], [0.1, 0.1]]}, "different lengths"),
        (lambda d: {**d, "scores": [[0.1, "x"], [0.2, 0.3], [0.1, 0.1]]}, "non-number"),
        (lambda d: {**d, "model": {"name_or_path": "x"}}, "field 'model'"),
    ],
)
def test_malformed_files_are_rejected(mask, tmp_path, edit, match):
    m, _ = mask
    with pytest.raises(HeadMaskError, match=match):
        HeadMask.load(_write(tmp_path, edit(m.to_dict())))


@pytest.mark.parametrize("bad", ["NaN", "Infinity"])
def test_non_finite_scores_are_rejected(mask, tmp_path, bad):
    m, _ = mask
    doc = m.to_dict()
    doc["scores"][1][0] = "__BAD__"
    text = json.dumps(doc).replace('"__BAD__"', bad)
    with pytest.raises(HeadMaskError, match="non-finite"):
        HeadMask.load(_write(tmp_path, text))


@pytest.mark.parametrize("value", [1.5, -0.25])
def test_scores_outside_unit_interval_are_rejected(mask, tmp_path, value):
    m, _ = mask
    doc = m.to_dict()
    doc["scores"][1][0] = value
    with pytest.raises(HeadMaskError, match=r"layer 1, head 0 is outside \[0, 1\]"):
        HeadMask.load(_write(tmp_path, json.dumps(doc)))


def test_bad_tsv_is_rejected(mask, tmp_path):
    _, model = mask
    (tmp_path / "a.tsv").write_text("0.1\t0.2\n0.3\tfoo\n0.1\t0.1\n")
    with pytest.raises(HeadMaskError, match="line 2"):
        HeadMask.from_tsv(tmp_path / "a.tsv", model)
    (tmp_path / "b.tsv").write_text("0.1\t0.2\n")
    with pytest.raises(HeadMaskError, match="shape"):
        HeadMask.from_tsv(tmp_path / "b.tsv", model)


@pytest.mark.parametrize("s", [-0.1, 1.5, float("nan"), "half"])
def test_sparsity_outside_unit_interval_is_rejected(mask, s):
    m, _ = mask
    with pytest.raises(HeadMaskError, match="sparsity"):
        m.full_heads(s)


def test_random_mask_is_seeded(mask):
    _, model = mask
    assert torch.equal(HeadMask.random(model, seed=3).scores, HeadMask.random(model, seed=3).scores)
    assert not torch.equal(HeadMask.random(model, seed=3).scores, HeadMask.random(model, seed=4).scores)
