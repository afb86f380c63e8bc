"""Completion log-probs through the frozen LM head: equal to a plain log_softmax and to TRL's own path."""

from __future__ import annotations

import os

import pytest
import torch
from test_trainer import config, constant_reward, prompts_dataset
from trl import GRPOTrainer

from rlkv.testing import tiny_model
from rlkv.trainers import GateGRPOTrainer
from rlkv.trainers.logprobs import token_logps


@pytest.mark.parametrize("keep_logits_bytes", [0, 1 << 30], ids=["recompute", "keep"])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logps_equal_plain_log_softmax_values_entropy_and_gradients(
    temperature, entropy_grad, keep_logits_bytes
):
    torch.manual_seed(0)
    n, h, v = 37, 16, 101
    hidden = torch.randn(n, h, dtype=torch.float64)
    weight, bias = 0.3 * torch.randn(v, h, dtype=torch.float64), torch.randn(v, dtype=torch.float64)
    targets = torch.randint(0, v, (n,))
    g_lp, g_ent = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    g_ent = g_ent if entropy_grad else torch.zeros_like(g_ent)  # GRPO's loss: entropy only logged

    ref_h = hidden.clone().requires_grad_()
    log_p = torch.log_softmax((ref_h @ weight.T + bias) / temperature, -1)
    ref_lp = log_p.gather(-1, targets[:, None])[:, 0]
    ref_ent = -(log_p.exp() * log_p).sum(-1)
    (ref_lp * g_lp + ref_ent * g_ent).sum().backward()

    our_h = hidden.clone().requires_grad_()
    lp, ent = token_logps(
        our_h,
        weight,
        targets,
        bias=bias,
        temperature=temperature,
        with_entropy=True,
        chunk=8,
        keep_logits_bytes=keep_logits_bytes,
    )
    ((lp * g_lp + ent * g_ent) if entropy_grad else lp * g_lp).sum().backward()
    # softmax statistics are fp32 by design; the reference is float64
    for ours, ref in ((lp, ref_lp), (ent, ref_ent), (our_h.grad, ref_h.grad)):
        torch.testing.assert_close(ours.detach().double(), ref.detach(), rtol=1e-5, atol=1e-5)


def test_token_logps_refuses_a_trainable_head():
    with pytest.raises(ValueError, match="frozen"):
        token_logps(torch.randn(2, 4), torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1]))


@pytest.mark.cross_path_floats
def test_gate_trainer_logps_equal_trls_fused_head_values_and_gate_gradients(tmp_path, tokenizer):
    model = tiny_model("qwen2")
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=constant_reward(0.0),
        args=config(tmp_path, max_completion_length=8, gate_init=0.6, temperature=0.8),
        train_dataset=prompts_dataset(1),
        processing_class=tokenizer,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (3, 14))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # a left-padded row

    def run(method):
        model.rlkv_gates.alpha.grad = None
        lp, ent, _ = method(trainer, model, ids, mask, 6, batch_size=2, compute_entropy=True)
        (lp * mask[:, -6:]).sum().backward()
        return lp.detach(), ent, model.rlkv_gates.alpha.grad.clone()

    ours = run(GateGRPOTrainer._get_per_token_logps_and_entropies)
    trls = run(GRPOTrainer._get_per_token_logps_and_entropies)
    for a, b in zip(ours, trls):
        assert (a - b).abs().max() <= 1e-5
    assert ours[2].abs().sum() > 0


def test_trainer_sets_cpu_threads_from_config(tmp_path, tokenizer):
    for requested, expected in ((1, 1), (0, len(os.sched_getaffinity(0)))):
        torch.set_num_threads(3)
        GateGRPOTrainer(
            model=tiny_model("llama"),
            reward_funcs=constant_reward(0.0),
            args=config(tmp_path / f"run{requested}", torch_threads=requested),
            train_dataset=prompts_dataset(1),
            processing_class=tokenizer,
        )
        assert torch.get_num_threads() == expected
