"""Ranking heads whose gates tie: the gates' `below_zero`, its checkpoint round trip, the fallback for
older checkpoints, and the shipped mask (no cut decided by index)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rlkv
from rlkv.head_mask import TIE_BREAK_BELOW_ZERO, HeadMask
from rlkv.testing import tiny_model
from rlkv.trainers.checkpoints import (
    TIE_BREAK_PENDING_STEP,
    checkpoint_tie_break,
    head_mask_from_checkpoint,
    load_below_zero,
    save_gate_checkpoint,
)

SHIPPED = Path(__file__).resolve().parents[1] / "results" / "masks" / "qwen2.5-coder-0.5b-instruct"
ABLATION = SHIPPED.with_name("qwen2.5-coder-0.5b-instruct-ablation")


def test_clamp_sums_what_it_cuts_below_zero():
    model = tiny_model("llama", num_hidden_layers=2, num_key_value_heads=2)
    gates = rlkv.attach_gates(model)
    gates.alpha.data = torch.tensor([[-0.2, 0.5], [1.5, -0.05]])
    gates.clamp_()
    gates.alpha.data -= torch.tensor([[0.1, 0.0], [0.0, 0.3]])
    gates.clamp_()
    assert torch.allclose(gates.below_zero, torch.tensor([[-0.3, 0.0], [0.0, -0.35]]))
    assert torch.equal(gates.alpha, torch.tensor([[0.0, 0.5], [1.0, 0.0]]))
    mask = HeadMask.from_gates(gates, model)
    # both (0,0) and (1,1) score 0.0: (1,1) was pushed further down, so (0,0) keeps its full cache first
    assert mask.full_heads(0.25).tolist() == [[True, True], [True, False]]
    assert mask.metadata["tie_break"] == TIE_BREAK_BELOW_ZERO and mask.index_decided_ties() == 0


def test_gate_checkpoint_keeps_below_zero_and_exports_it_as_the_tie_break(tmp_path):
    model = tiny_model("llama", num_hidden_layers=2, num_key_value_heads=2)
    alpha = torch.tensor([[0.0, 0.4], [0.0, 0.9]])
    below_zero = torch.tensor([[-2.0, 0.0], [-0.5, 0.0]])
    written = save_gate_checkpoint(tmp_path, alpha, 16, 64, model.config, below_zero=below_zero)
    assert torch.equal(load_below_zero(tmp_path), below_zero)
    mask = head_mask_from_checkpoint(tmp_path)
    assert torch.equal(mask.tie_break, below_zero) and torch.equal(written.tie_break, below_zero)
    assert mask.full_heads(0.25).tolist() == [[False, True], [True, True]]
    assert HeadMask.load(tmp_path / "head_mask.json").index_decided_ties() == 0


def test_older_checkpoints_rank_zero_gates_by_the_pending_adam_step(tmp_path):
    """Before `below_zero` existed, a checkpoint's optimizer.pt still says how the loss pushes each gate:
    the gate pushed down step after step ranks below one whose gradient changed sign."""
    model = tiny_model("llama", num_hidden_layers=1, num_key_value_heads=2)
    alpha = torch.nn.Parameter(torch.tensor([[0.0, 0.0]]))
    optimizer = torch.optim.AdamW([alpha], lr=0.02, weight_decay=0.017)
    for step in range(6):
        alpha.grad = torch.tensor([[1.0, 1.0 if step % 2 else -1.0]])  # head 1: pushed back and forth
        optimizer.step()
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    save_gate_checkpoint(tmp_path, torch.zeros(1, 2), 16, 64, model.config)
    assert load_below_zero(tmp_path) is None
    tie_break, source = checkpoint_tie_break(tmp_path)
    assert source == TIE_BREAK_PENDING_STEP and tie_break[0, 0] < tie_break[0, 1] < 0
    mask = head_mask_from_checkpoint(tmp_path)
    assert mask.full_heads(0.5).tolist() == [[False, True]] and mask.metadata["tie_break"] == source


def test_a_checkpoint_without_either_has_no_tie_break(tmp_path):
    model = tiny_model("llama", num_hidden_layers=1, num_key_value_heads=2)
    save_gate_checkpoint(tmp_path, torch.zeros(1, 2), 16, 64, model.config)
    assert checkpoint_tie_break(tmp_path) is None and head_mask_from_checkpoint(tmp_path).tie_break is None


@pytest.mark.parametrize("sparsity", [0.5, 0.75, 0.875])
def test_shipped_mask_decides_no_cut_by_index_and_keeps_its_evaluated_layouts(sparsity):
    mask = HeadMask.load(SHIPPED / "head_mask.json")
    assert mask.tie_break is not None and mask.index_decided_ties() == 0
    # the committed eval grid ran these sparsities with the scores alone: the tie-break changes none
    scores_only = HeadMask(scores=mask.scores, fingerprint=mask.fingerprint)
    assert torch.equal(mask.full_heads(sparsity), scores_only.full_heads(sparsity))


@pytest.mark.parametrize("folder", [SHIPPED, ABLATION])
def test_shipped_cards_name_the_hub_base_model(folder):
    card = (folder / "README.md").read_text()
    assert "\nbase_model: Qwen/Qwen2.5-Coder-0.5B-Instruct\n" in card.split("---")[1] + "\n"
