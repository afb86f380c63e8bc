"""The trainer's levers for a target sparsity: gates initialised from another mask's ranking, and an L1
term that leaves the heads the deployed mask keeps full alone."""

from __future__ import annotations

import pytest
import torch

from rlkv.head_mask import HeadMask, HeadMaskError, ModelFingerprint
from rlkv.testing import tiny_model
from rlkv.trainers import GateGRPOTrainer, l1_penalty
from rlkv.trainers.gate_trainer import outside_target
from tests.test_trainer import config, constant_reward, prompts_dataset


def _saved_mask(model, scores, path):
    mask = HeadMask(scores=scores, fingerprint=ModelFingerprint.of(model))
    return mask.save(path / "ablation.json")


def test_gates_start_from_another_masks_ranking(tmp_path, tokenizer):
    model = tiny_model("qwen2")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    n = layers * heads
    scores = torch.rand(layers, heads, generator=torch.Generator().manual_seed(0))
    path = _saved_mask(model, scores, tmp_path)
    GateGRPOTrainer(
        model=model,
        reward_funcs=constant_reward(1.0),
        args=config(tmp_path, gate_init=0.9, gate_init_low=0.3, gate_init_from=str(path)),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    alpha = model.rlkv_gates.alpha.detach()
    rank = torch.empty(n, dtype=torch.long)
    rank[torch.argsort(scores.flatten(), descending=True)] = torch.arange(n)
    expected = 0.9 - 0.6 * rank.float() / (n - 1)
    assert torch.allclose(alpha.flatten(), expected)
    # the same ranking: the mask's most important heads are the gates' most important heads
    assert torch.equal(HeadMask.from_gates(alpha, model).full_heads(0.5), HeadMask.load(path).full_heads(0.5))


def test_a_mask_of_another_geometry_is_refused_before_training(tmp_path, tokenizer):
    other = tiny_model("qwen2", num_hidden_layers=3)
    path = _saved_mask(other, torch.rand(3, other.config.num_key_value_heads), tmp_path)
    with pytest.raises(HeadMaskError, match="num_hidden_layers"):
        GateGRPOTrainer(
            model=tiny_model("qwen2"),
            reward_funcs=constant_reward(1.0),
            args=config(tmp_path, gate_init_from=str(path)),
            train_dataset=prompts_dataset(),
            processing_class=tokenizer,
        )


def test_outside_target_is_the_heads_the_mask_would_compress():
    alpha = torch.tensor([[0.9, 0.0], [0.0, 0.4], [0.0, 0.7]])
    below_zero = torch.tensor([[0.0, -3.0], [-1.0, 0.0], [-0.5, 0.0]])
    # keep round(0.5 * 6) = 3: 0.9, 0.7, 0.4; then among the zeros (2,0) ranks above (1,0) and (0,1)
    assert outside_target(alpha, below_zero, 0.5).tolist() == [[False, True], [True, False], [True, False]]
    assert outside_target(alpha, below_zero, 1 / 3).tolist() == [[False, True], [True, False], [False, False]]
    leaf = torch.tensor([[0.9, 0.1], [0.2, 0.4], [0.3, 0.7]], requires_grad=True)
    l1_penalty(leaf, 0.6, outside_target(leaf, torch.zeros(3, 2), 0.5)).backward()
    # each gate in scope gets the gradient of the 'all' penalty (weight / (L * H)); the others none
    assert torch.allclose(leaf.grad, torch.tensor([[0.0, 0.1], [0.1, 0.0], [0.1, 0.0]]))


@pytest.mark.parametrize("scope", ["all", "outside_target"])
def test_with_outside_target_the_penalty_never_moves_the_kept_heads(tmp_path, tokenizer, scope):
    """A constant reward: every advantage is 0, so the penalty is the only gradient. With 'all' it lowers
    every gate; with 'outside_target' only the heads outside the target's top-k move."""
    model = tiny_model("qwen2")
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    scores = torch.arange(layers * heads, dtype=torch.float32).view(layers, heads) / (layers * heads)
    path = _saved_mask(model, scores, tmp_path)
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=constant_reward(1.0),
        args=config(
            tmp_path,
            gate_init_from=str(path),
            gate_init=0.9,
            gate_init_low=0.5,
            penalty_scope=scope,
            target_sparsity=0.5,
            l1_beta=1.0,
            reward_threshold=0.0,
            weight_decay=0.0,
            max_steps=2,
        ),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    before = model.rlkv_gates.alpha.detach().clone()
    kept = HeadMask.from_gates(before, model).full_heads(0.5)
    trainer.train()
    after = model.rlkv_gates.alpha.detach()
    assert (after[~kept] < before[~kept]).all()
    if scope == "all":
        assert (after[kept] < before[kept]).all()
    else:
        assert torch.equal(after[kept], before[kept])


@pytest.mark.parametrize(
    "overrides,match",
    [
        ({"penalty_scope": "topk"}, "penalty_scope='topk' is invalid"),
        ({"gate_forward": "ste"}, "gate_forward='ste' is invalid"),
        (
            {"gate_init": 0.4, "gate_init_low": 0.6, "gate_init_from": "m.json"},
            "gate_init_low=0.6 is invalid",
        ),
        ({"gate_init_low": 1.5}, "gate_init_low=1.5 is invalid"),
    ],
)
def test_bad_lever_settings_name_the_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, **overrides)
