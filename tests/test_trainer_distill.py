"""Issue 48's objectives: the distillation term, its trainer, the budget penalty and GRPO's KL against the
gated model's own full attention (tiny models and the shipped demo model; no network)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from rlkv.data import load_problems
from rlkv.data.batches import teacher_forced_batch
from rlkv.gates import attach_gates, full_attention
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model
from rlkv.trainers import GateGRPOConfig, GateGRPOTrainer
from rlkv.trainers.distill import GateDistillTrainer, distill_sequences
from rlkv.trainers.distill_loss import distill_kl, forward_kl, top_fraction_kl
from rlkv.trainers.gate_trainer import budget_penalty, gate_penalty
from rlkv.trainers.grpo import FullAttentionReference
from rlkv.trainers.logprobs import completion_logps

DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo-model"
SEQUENCES = [([5, 9, 14, 3], [7, 8, 21, 4, 2]), ([11, 12], [13, 30, 2]), ([40, 41, 42, 43, 44], [45, 2])]


def distill_config(tmp_path, **overrides) -> GateGRPOConfig:
    """A small CPU config (distillation unless `objective` is overridden)."""
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=3,
        max_steps=2,
        gate_sink=2,
        gate_local=3,
        save_strategy="no",
        logging_steps=1,
        objective="distill",
        seed=0,
    )
    kwargs.update(overrides)
    return GateGRPOConfig(**kwargs)


def test_forward_kl_matches_autograd_in_value_and_gradient():
    # a different code path (chunked, hand-written backward) than autograd: compared with a tolerance
    torch.manual_seed(0)
    hidden = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    ref = torch.randn(11, 8, dtype=torch.float64)
    weight, bias = torch.randn(37, 8, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    kl = forward_kl(hidden, ref, weight, bias, chunk=4)
    log_p = torch.log_softmax(ref @ weight.T + bias, -1)
    log_q = torch.log_softmax(hidden @ weight.T + bias, -1)
    expected = (log_p.exp() * (log_p - log_q)).sum(-1)
    torch.testing.assert_close(kl, expected.float(), atol=1e-6, rtol=1e-6)
    upstream = torch.rand(11, dtype=torch.float64)
    (grad,) = torch.autograd.grad((kl * upstream).sum(), hidden)
    (grad_ref,) = torch.autograd.grad((expected * upstream).sum(), hidden)
    torch.testing.assert_close(grad, grad_ref, atol=1e-6, rtol=1e-5)
    assert (kl >= 0).all()


def test_forward_kl_refuses_a_trainable_head():
    w = torch.randn(5, 3, requires_grad=True)
    with pytest.raises(ValueError, match="must be frozen"):
        forward_kl(torch.randn(2, 3), torch.randn(2, 3), w)


def test_full_attention_is_the_stock_model_whatever_the_gates(family):
    stock = tiny_model(family)
    batch = teacher_forced_batch(SEQUENCES)
    inputs = dict(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    )
    with torch.no_grad():
        expected = stock(**inputs).logits
    gates = attach_gates(stock, sink=1, local=2, init=0.2)
    with torch.no_grad(), full_attention(stock):
        got = stock(**inputs).logits
    assert not gates.bypassed
    # the same SDPA kernels on the same shapes: bitwise
    assert torch.equal(got, expected)
    with torch.no_grad():
        gated = stock(**inputs).logits
    assert not torch.allclose(gated, expected, atol=1e-4), (
        "the gates at 0.2 must change the output outside the block"
    )


def test_kl_is_zero_at_gates_one_and_its_gradient_reaches_only_the_gates(family):
    model = tiny_model(family)
    gates = attach_gates(model, sink=1, local=2, init=1.0)
    batch = teacher_forced_batch(SEQUENCES)
    kl = distill_kl(model, model, batch)
    torch.testing.assert_close(kl, torch.zeros_like(kl), atol=1e-6, rtol=0)
    with torch.no_grad():
        gates.alpha.fill_(0.4)
    kl = distill_kl(model, model, batch)
    assert kl.mean() > 1e-4
    kl.mean().backward()
    assert gates.alpha.grad is not None and gates.alpha.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if n != "rlkv_gates.alpha")


def test_top_fraction_kl_averages_the_largest_token_kls_and_trains_only_the_gates():
    """`distill_top_fraction`: the ceil(f * N) largest per-token KLs summed over N (f = 1: the mean), whose
    gradient reaches the gates only; a fraction outside (0, 1] names the field."""
    model = tiny_model("llama")
    gates = attach_gates(model, sink=1, local=2, init=0.4)
    batch = teacher_forced_batch(SEQUENCES)
    kl = distill_kl(model, model, batch)
    assert top_fraction_kl(kl, 1.0) == kl.mean()
    count = math.ceil(0.25 * kl.numel())
    top = top_fraction_kl(kl, 0.25)
    expected = kl.sort(descending=True).values[:count].sum() / kl.numel()
    torch.testing.assert_close(top, expected, rtol=1e-6, atol=0)
    assert 0.25 * kl.mean() < top < kl.mean()  # most of the KL sits in the largest quarter
    top.backward()
    assert gates.alpha.grad.abs().sum() > 0
    assert all(p.grad is None for n, p in model.named_parameters() if n != "rlkv_gates.alpha")
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="distill_top_fraction"):
            GateGRPOConfig(output_dir="unused", distill_top_fraction=bad)


def test_budget_penalty_pushes_only_above_the_budget():
    alpha = torch.full((4, 2), 0.25, requires_grad=True)  # mean 0.25 = the budget at s = 0.75
    assert budget_penalty(alpha, 1.0, 0.75).item() == 0.0
    above = torch.full((4, 2), 0.5, requires_grad=True)
    penalty = gate_penalty(above, torch.zeros(4, 2), 2.0, "budget", 0.75)
    torch.testing.assert_close(penalty, torch.tensor(2.0 * 0.25))
    penalty.backward()
    torch.testing.assert_close(above.grad, torch.full((4, 2), 2.0 / 8))
    with pytest.raises(ValueError, match="penalty_scope"):
        gate_penalty(above, torch.zeros(4, 2), 1.0, "nowhere", 0.75)


def demo_sequences(num: int):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlkv.ablation import greedy_solutions

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    problems = load_problems("chain", split="train", num=num, seed=0)
    return (
        model,
        tokenizer,
        greedy_solutions(model, tokenizer, problems, 48, template="plain", progress=False),
    )


def test_distillation_loss_falls_on_the_demo_task(tmp_path):
    model, tokenizer, sequences = demo_sequences(8)
    gates = attach_gates(model, sink=16, local=64, init=0.0)  # every head sink + local: far from full
    batch = teacher_forced_batch(sequences)
    with torch.no_grad():
        before = distill_kl(model, model, batch).mean().item()
    args = distill_config(
        tmp_path,
        gate_sink=16,
        gate_local=64,
        per_device_train_batch_size=8,
        max_steps=8,
        learning_rate=0.1,
        l1_beta=0.0,
    )
    trainer = GateDistillTrainer(model, args, sequences, processing_class=tokenizer)
    trainer.train()
    with torch.no_grad():
        after = distill_kl(model, model, batch).mean().item()
    assert after < 0.5 * before, (before, after)
    assert gates.alpha.min() >= 0 and gates.alpha.max() <= 1
    logged = [r for r in trainer.state.log_history if "distill/kl" in r]
    assert len(logged) == 8 and logged[-1]["distill/kl"] < logged[0]["distill/kl"]
    assert (Path(args.output_dir) / "head_mask.json").is_file()
    # the reference hidden states were computed once per sequence and kept; other batch paddings, so a tolerance
    assert sorted(trainer._reference) == list(range(len(sequences)))
    kept = torch.cat([trainer._reference[i] for i in range(len(sequences))])
    with torch.no_grad():
        torch.testing.assert_close(
            distill_kl(model, model, batch, kept), distill_kl(model, model, batch), atol=1e-5, rtol=1e-4
        )


def test_hard_forward_distillation_trains_the_deployed_layout_on_the_demo_task(tmp_path):
    """gate_forward='hard': the trainer runs the mask at target_sparsity in every forward (2 of the demo
    model's 8 heads full at s = 0.75) and the KL of that layout falls as the gates re-rank from the
    worst start there is (every gate tied, so the layout is layer 0's two heads)."""
    model, tokenizer, sequences = demo_sequences(8)
    gates = attach_gates(model, sink=16, local=64, init=0.25)
    batch = teacher_forced_batch(sequences)
    gates.hard_keep = 2
    with torch.no_grad():
        before = distill_kl(model, model, batch).mean().item()
    gates.hard_keep = None
    args = distill_config(
        tmp_path,
        gate_sink=16,
        gate_local=64,
        gate_forward="hard",
        target_sparsity=0.75,
        optim="sgd",
        per_device_train_batch_size=8,
        max_steps=8,
        learning_rate=0.05,
        l1_beta=0.5,
        penalty_scope="budget",
    )
    trainer = GateDistillTrainer(model, args, sequences, processing_class=tokenizer)
    assert gates.hard_keep == 2
    trainer.train()
    with torch.no_grad():
        after = distill_kl(model, model, batch).mean().item()
    assert after < 0.5 * before, (before, after)
    full = HeadMask.from_gates(gates, model).full_heads(0.75)
    assert not full[0].any()  # layer 0's heads, the start, were swapped out


def test_distill_sequences_need_completions_and_cut_long_ones(tokenizer):
    rows = Dataset.from_dict({"prompt": ["1 + 2 =", "x"], "completion": ["3. 2 * 3 = 6.", ""]})
    sequences = distill_sequences(rows, tokenizer, max_length=6)
    prompt = tokenizer("1 + 2 =")["input_ids"]
    assert len(sequences) == 2 and sequences[0][0] == prompt
    assert len(sequences[0][0]) + len(sequences[0][1]) == 6  # cut at max_length
    assert sequences[1][1] == [tokenizer.eos_token_id]  # an empty completion still teaches the stop
    with pytest.raises(ValueError, match="completion"):
        distill_sequences(Dataset.from_dict({"prompt": ["a"]}), tokenizer, max_length=8)


def test_grpo_kl_reference_is_the_stock_model_without_a_second_copy(tmp_path, tokenizer):
    stock = tiny_model("qwen2").requires_grad_(False)
    batch = teacher_forced_batch(SEQUENCES)
    width = batch.input_ids.shape[1]
    with torch.no_grad():
        expected, _ = completion_logps(
            stock, stock.get_output_embeddings(), batch.input_ids, batch.attention_mask, 3
        )
    parameters = sum(p.numel() for p in stock.parameters())
    args = distill_config(
        tmp_path,
        objective="grpo",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        max_steps=1,
        gate_sink=1,
        gate_local=2,
        gate_init=0.3,
        beta=0.1,
    )
    trainer = GateGRPOTrainer(
        model=stock,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["1 + 2 =", "let x be 3"] * 4}),
        processing_class=tokenizer,
    )
    assert isinstance(trainer.ref_model, FullAttentionReference) and trainer.beta == 0.1
    assert sum(p.numel() for p in trainer.model.parameters()) == parameters + stock.rlkv_gates.alpha.numel()
    got, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.ref_model, batch.input_ids, batch.attention_mask, 3
    )
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    gated, _, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, batch.input_ids, batch.attention_mask, 3
    )
    assert not torch.allclose(gated, expected, atol=1e-4)
    assert width == batch.input_ids.shape[1]
    trainer.train()
    kl = [r["kl"] for r in trainer.state.log_history if "kl" in r]
    assert kl and kl[0] > 0, "TRL's KL term must be logged and positive with gates below 1"


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"objective": "sft"}, "objective"),
        ({"distill_steps": 0}, "distill_steps"),
        ({"sync_ref_model": True}, "sync_ref_model"),
    ],
)
def test_bad_objective_settings_name_the_field(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        distill_config(tmp_path, **overrides)


def test_recipe_objectives_distill_and_distill_then_grpo(tmp_path):
    """`rlkv train --objective distill+grpo`: the distillation stage's run in output_dir/distill, then GRPO
    from exactly its gates (GRPO's learning rate 0 here, so the final gates are the distilled ones)."""
    from rlkv.trainers.checkpoints import load_gate_checkpoint
    from rlkv.trainers.script import main

    problems = load_problems("chain", split="train", num=8, seed=0).to_pandas()
    problems["completion"] = problems["solution"]
    data = tmp_path / "solutions.jsonl"
    problems.to_json(data, orient="records", lines=True)
    common = [
        "--model_name_or_path", str(DEMO_MODEL), "--dataset_name", str(data), "--prompt_template", "plain",
        "--gate_sink", "16", "--gate_local", "64", "--gate_init", "0.25", "--target_sparsity", "0.75",
        "--penalty_scope", "budget", "--l1_beta", "0.5", "--use_cpu", "true", "--report_to", "none",
        "--disable_tqdm", "true", "--save_strategy", "no", "--seed", "0",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
    ]  # fmt: skip
    out = tmp_path / "both"
    argv = ["--objective", "distill+grpo", "--distill_steps", "3", "--distill_learning_rate", "0.1"]
    argv += ["--learning_rate", "0.0", "--weight_decay", "0.0", "--max_steps", "1", "--output_dir", str(out)]
    assert main(common + argv) == 0
    distilled, _ = load_gate_checkpoint(out / "distill")
    final, _ = load_gate_checkpoint(out)
    assert not torch.equal(distilled, torch.full_like(distilled, 0.25)), "distillation did not move the gates"
    torch.testing.assert_close(final, distilled, atol=0, rtol=0)  # GRPO (lr 0) started from them
    assert HeadMask.load(out / "distill" / "head_mask.json").metadata["objective"] == "distill"
    assert HeadMask.load(out / "head_mask.json").metadata["trainer"] == "rlkv.trainers.GateGRPOTrainer"

    alone = tmp_path / "distill"
    argv = [
        "--objective",
        "distill",
        "--learning_rate",
        "0.1",
        "--max_steps",
        "2",
        "--output_dir",
        str(alone),
    ]
    assert main(common + argv) == 0
    assert HeadMask.load(alone / "head_mask.json").metadata["global_step"] == 2
    assert not (alone / "distill").exists()


def test_distill_objective_without_completions_is_one_error_line(tmp_path, capsys):
    from rlkv.trainers.script import main

    argv = ["--model_name_or_path", str(DEMO_MODEL), "--dataset_name", "chain", "--dataset_num", "4"]
    argv += ["--objective", "distill", "--use_cpu", "true", "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("train_gates.py: error: bad recipe: objective 'distill' needs")
    assert "rlkv data curriculum" in err[-1]
