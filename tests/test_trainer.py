"""GateGRPOTrainer on tiny models: only the gates train, RLKV's penalty term, policy gradient, checkpoints, resume."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from rlkv.cli import export_mask
from rlkv.gates import attach_gates
from rlkv.head_mask import HeadMask
from rlkv.testing import tiny_model
from rlkv.trainers import GateGRPOConfig, GateGRPOTrainer, l1_penalty, penalty_weight

PROMPTS = [
    "let x be 3 then x + 4 = 7 so we have",
    "solve the following math problem efficiently and clearly",
    "1 + 2 = 3. 2 * 3 = 6. 4 + 5 =",
    "wait alternatively again compute sum product total",
]


def prompts_dataset(repeat: int = 8) -> Dataset:
    return Dataset.from_dict({"prompt": PROMPTS * repeat})


def config(tmp_path, **overrides) -> GateGRPOConfig:
    kwargs = dict(
        output_dir=str(tmp_path / "out"),
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=12,
        max_steps=2,
        gate_sink=2,
        gate_local=4,
        save_strategy="no",
        seed=0,
    )
    kwargs.update(overrides)
    return GateGRPOConfig(**kwargs)


def token_reward(prompts, completions, completion_ids, **kwargs):
    """A deterministic function of the sampled tokens (fraction of ids divisible by 3)."""
    return [sum(1 for t in ids if t % 3 == 0) / max(1, len(ids)) for ids in completion_ids]


def constant_reward(value: float):
    def reward(prompts, completions, **kwargs):
        return [value] * len(completions)

    return reward


def test_only_alpha_trains_and_model_weights_stay_bit_identical(tmp_path, tokenizer, family):
    model = tiny_model(family)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=token_reward,
        args=config(tmp_path, max_steps=3, l1_beta=0.05, reward_threshold=0.0),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    assert [n for n, p in model.named_parameters() if p.requires_grad] == ["rlkv_gates.alpha"]
    optimized = [p for group in trainer.create_optimizer().param_groups for p in group["params"]]
    assert len(optimized) == 1 and optimized[0] is model.rlkv_gates.alpha
    trainer.train()
    alpha = model.rlkv_gates.alpha.detach()
    assert not torch.equal(alpha, torch.ones_like(alpha)), "gates did not move"
    assert alpha.min() >= 0 and alpha.max() <= 1, "gates must stay clamped to [0, 1]"
    after = model.state_dict()
    assert set(after) == set(before) | {"rlkv_gates.alpha"}
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), f"{name} changed"


@pytest.mark.parametrize(
    ("r_bar", "tau", "adaptive", "expected"),
    [
        (0.75, 0.5, True, 1e-3 * (math.exp(0.75) - 1)),
        (0.5, 0.5, True, 0.0),  # cutoff is strict: r_bar <= tau gives exactly 0
        (0.2, 0.5, True, 0.0),
        (0.51, 0.5, True, 1e-3 * (math.exp(0.51) - 1)),
        (0.2, 0.5, False, 1e-3),  # ablation: constant beta
        (float("nan"), 0.5, True, 0.0),
    ],
)
def test_penalty_weight_formula(r_bar, tau, adaptive, expected):
    assert penalty_weight(r_bar, 1e-3, tau, adaptive) == pytest.approx(expected, rel=1e-12, abs=0)


def test_l1_penalty_is_beta_over_LH_times_l1_norm():
    alpha = torch.tensor([[0.2, 0.9, 0.0], [1.0, 0.4, 0.7]], requires_grad=True)
    penalty = l1_penalty(alpha, 0.3)
    assert penalty.item() == pytest.approx(0.3 / 6 * 3.2)
    penalty.backward()
    # d|a|/da = sign(a): a gate already at 0 gets no push (it is at the clamp boundary)
    assert torch.allclose(alpha.grad, 0.3 / 6 * alpha.detach().sign())


@pytest.mark.parametrize(
    ("reward", "tau", "adaptive", "grad_accum"),
    [(0.75, 0.5, True, 1), (0.5, 0.5, True, 1), (0.9, 0.5, True, 2), (0.1, 0.5, False, 1)],
)
def test_loss_term_in_training_equals_formula(tmp_path, tokenizer, reward, tau, adaptive, grad_accum):
    """With equal rewards in every group the advantages are 0, so TRL's GRPO loss and its gradient are exactly 0
    and what is left of the step is RLKV's penalty: loss and gate gradient must match the formula.
    Gradient accumulation must not change the per-step penalty (TRL's scaling)."""
    l1_beta, init = 0.2, 0.8
    model = tiny_model("llama")
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=constant_reward(reward),
        args=config(
            tmp_path,
            max_steps=1,
            l1_beta=l1_beta,
            reward_threshold=tau,
            adaptive_penalty=adaptive,
            gate_init=init,
            gradient_accumulation_steps=grad_accum,
            max_grad_norm=0.0,
        ),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    grads = []
    alpha = model.rlkv_gates.alpha
    trainer.add_callback(_GradRecorder(alpha, grads))
    trainer.train()
    weight = (l1_beta * math.expm1(reward) if reward > tau else 0.0) if adaptive else l1_beta
    logged = trainer.state.log_history[0]
    assert logged["rlkv/beta_prime"] == pytest.approx(weight, rel=1e-6)
    assert logged["rlkv/r_bar"] == pytest.approx(reward, rel=1e-6)
    assert logged["rlkv/l1_penalty"] == pytest.approx(weight * init, rel=1e-6)
    assert logged["loss"] == pytest.approx(weight * init, rel=1e-5, abs=1e-12)
    expected_grad = torch.full_like(alpha, weight / alpha.numel())
    assert torch.allclose(grads[0], expected_grad, rtol=1e-5, atol=0), (grads[0], expected_grad)
    if weight == 0.0:
        assert torch.equal(grads[0], torch.zeros_like(alpha)), (
            "below the cutoff the penalty must be exactly 0"
        )


class _GradRecorder(TrainerCallback):
    """Records the gate gradient right before each optimizer step."""

    def __init__(self, alpha: torch.Tensor, out: list):
        self.alpha, self.out = alpha, out

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.out.append(self.alpha.grad.detach().clone())


# policy gradient ------------------------------------------------------------------------------
FAVOURED = torch.tensor([[True, False], [False, True]])  # (layer, KV head) pairs the reward wants full


def model_with_dead_heads(family: str = "llama"):
    """Tiny model whose non-favoured KV heads write nothing (their o_proj columns are 0): their gates
    cannot change the policy, so only the penalty and weight decay can move them."""
    model = tiny_model(family)
    head_dim, groups = (
        model.config.head_dim,
        model.config.num_attention_heads // model.config.num_key_value_heads,
    )
    width = head_dim * groups  # o_proj input columns fed by one KV head's query group
    with torch.no_grad():
        for layer_idx, layer in enumerate(model.model.layers):
            for kv in range(model.config.num_key_value_heads):
                if not FAVOURED[layer_idx, kv]:
                    layer.self_attn.o_proj.weight[:, kv * width : (kv + 1) * width] = 0
    return model


def full_attention_evidence_reward(tokenizer, sink: int, local: int, init: float):
    """Reward = per-token log-likelihood ratio of the completion between a judge with the favoured heads
    full (alpha 1) and with them sink+local (alpha 0): completions typical of full attention on those
    heads score high. A deterministic function of the prompt and the sampled ids."""
    judge = model_with_dead_heads()
    gates = attach_gates(judge, sink=sink, local=local, init=init)

    @torch.no_grad()
    def completion_logp(ids: list[int], n: int, favoured_value: float) -> float:
        gates.alpha.fill_(init)
        gates.alpha[FAVOURED] = favoured_value
        logp = judge(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        return logp.gather(1, torch.tensor(ids[1:])[:, None])[-n:].sum().item()

    def reward(prompts, completions, completion_ids, **kwargs):
        scores = []
        for prompt, completion in zip(prompts, completion_ids):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] + list(completion)
            n = max(1, len(completion))
            scores.append((completion_logp(ids, n, 1.0) - completion_logp(ids, n, 0.0)) / n)
        return scores

    return reward


def test_policy_gradient_raises_gates_of_heads_the_reward_needs_full(tmp_path, tokenizer):
    """RLKV in miniature: the L1 penalty pulls every gate down, the reward holds up (here: raises)
    the gates of the heads whose full attention it favours."""
    sink, local, init = 1, 2, 0.5
    model = model_with_dead_heads()
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=full_attention_evidence_reward(tokenizer, sink, local, init),
        args=config(
            tmp_path,
            max_steps=10,
            per_device_train_batch_size=8,
            max_completion_length=16,
            gate_sink=sink,
            gate_local=local,
            gate_init=init,
            learning_rate=0.05,
            l1_beta=0.004,
            adaptive_penalty=False,
        ),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    trainer.train()
    alpha = model.rlkv_gates.alpha.detach()
    assert alpha[FAVOURED].min() > init + 0.15, alpha  # pushed up against the penalty: the policy gradient
    assert alpha[~FAVOURED].max() < init - 0.15, alpha  # only the penalty acts on heads that do not matter


# checkpoints ----------------------------------------------------------------------------------
def train_run(
    tmp_path,
    tokenizer,
    out: str,
    max_steps: int,
    resume: str | None = None,
    repeat: int = 8,
    gate_init: float = 1.0,
):
    model = tiny_model("qwen2")
    args = config(
        tmp_path,
        gate_init=gate_init,
        output_dir=str(tmp_path / out),
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=2,
        l1_beta=0.05,
        reward_threshold=0.0,
        gradient_accumulation_steps=2,
    )
    trainer = GateGRPOTrainer(
        model=model,
        reward_funcs=token_reward,
        args=args,
        train_dataset=prompts_dataset(repeat),
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=resume)
    return model, trainer


def test_resume_after_k_steps_equals_uninterrupted_run(tmp_path, tokenizer):
    """Same seeds: a run stopped at step 2 and resumed to step 5 ends with exactly the gates (and logged
    rewards) of one uninterrupted 5-step run: alpha, Adam state, RNG and data order are all restored, and
    so is what the clamp cut off below 0 (gates start near 0, so the penalty drives them under it)."""
    straight, straight_trainer = train_run(tmp_path, tokenizer, "straight", max_steps=5, gate_init=0.02)
    train_run(tmp_path, tokenizer, "stopped", max_steps=2, gate_init=0.02)
    resumed, resumed_trainer = train_run(
        tmp_path,
        tokenizer,
        "stopped",
        max_steps=5,
        resume=str(tmp_path / "stopped" / "checkpoint-2"),
        gate_init=0.02,
    )
    assert torch.equal(resumed.rlkv_gates.alpha, straight.rlkv_gates.alpha)
    below_zero = straight.rlkv_gates.below_zero
    assert below_zero.min() < 0 and torch.equal(resumed.rlkv_gates.below_zero, below_zero)
    rewards = [
        [h["reward"] for h in t.state.log_history if "reward" in h]
        for t in (straight_trainer, resumed_trainer)
    ]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 5


def test_resume_in_a_later_epoch_replays_that_epochs_shuffled_order(tmp_path, tokenizer):
    """4 prompts = 2 steps per epoch, shuffled (GRPOConfig's default): a run stopped at step 4 (end of
    epoch 1) and resumed to 6 sees epoch 2's prompt order, not epoch 0's again, so it ends with the
    gates and rewards of the uninterrupted run."""
    straight, straight_trainer = train_run(tmp_path, tokenizer, "straight", max_steps=6, repeat=1)
    assert straight_trainer.args.shuffle_dataset
    train_run(tmp_path, tokenizer, "stopped", max_steps=4, repeat=1)
    resumed, resumed_trainer = train_run(
        tmp_path,
        tokenizer,
        "stopped",
        max_steps=6,
        repeat=1,
        resume=str(tmp_path / "stopped" / "checkpoint-4"),
    )
    rewards = [
        [h["reward"] for h in t.state.log_history if "reward" in h]
        for t in (straight_trainer, resumed_trainer)
    ]
    assert rewards[0] == rewards[1] and len(rewards[0]) == 6
    assert torch.equal(resumed.rlkv_gates.alpha, straight.rlkv_gates.alpha)


def test_epoch_seeded_sampler_orders_by_epoch_and_fences_trls_fields():
    from torch.utils.data import SequentialSampler
    from trl.trainer.utils import RepeatSampler

    from rlkv.compat import UnsupportedVersionError
    from rlkv.trainers.data_order import EpochSeededSampler

    def order(epochs_before: int, epoch: int) -> list[int]:
        sampler = EpochSeededSampler(RepeatSampler(range(16), mini_repeat_count=1, shuffle=True, seed=3))
        for e in range(epochs_before):  # the passes an uninterrupted run made first
            sampler.set_epoch(e)
            list(sampler)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(2, 2) == order(0, 2) != order(0, 1)
    assert order(0, 0) == list(RepeatSampler(range(16), mini_repeat_count=1, shuffle=True, seed=3))
    unshuffled = EpochSeededSampler(RepeatSampler(range(4), mini_repeat_count=1, shuffle=False, seed=3))
    unshuffled.set_epoch(5)
    assert list(unshuffled) == [0, 1, 2, 3]
    with pytest.raises(UnsupportedVersionError, match="no attribute 'shuffle' on SequentialSampler"):
        EpochSeededSampler(SequentialSampler(range(4)))


def test_checkpoint_holds_gates_only_and_exports_a_valid_head_mask(tmp_path, tokenizer, capsys):
    model, trainer = train_run(tmp_path, tokenizer, "run", max_steps=2)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    names = {p.name for p in checkpoint.iterdir()}
    assert {"gates.safetensors", "config.json", "head_mask.json", "head_mask.tsv", "optimizer.pt"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin"}, "frozen weights must not be checkpointed"
    # no tokenizer either (~11 MB a checkpoint for a real model): resume and export use the model's own
    tokenizer_files = {
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    }
    for directory in (checkpoint, tmp_path / "run"):
        assert not {p.name for p in directory.iterdir()} & tokenizer_files, directory
    alpha = model.rlkv_gates.alpha.detach()
    for directory in (checkpoint, tmp_path / "run"):  # the checkpoint's copy and output_dir's latest
        mask = HeadMask.load(directory / "head_mask.json")
        mask.check_compatible(model)
        assert torch.equal(mask.scores, alpha)
        assert mask.metadata["global_step"] == 2 and mask.train_sink == 2 and mask.train_local == 4
        tsv = HeadMask.from_tsv(directory / "head_mask.tsv", model)
        assert torch.equal(tsv.scores, alpha)
    assert mask.fingerprint.name_or_path == "rlkv-tiny-qwen2"

    parser = argparse.ArgumentParser()
    export_mask.register(parser.add_subparsers())
    out = tmp_path / "exported.json"
    args = parser.parse_args(
        ["export-mask", str(checkpoint), "--out", str(out), "--tsv", str(tmp_path / "m.tsv")]
    )
    assert args.func(args) == 0
    exported = HeadMask.load(out)
    assert torch.equal(exported.scores, alpha) and exported.fingerprint == mask.fingerprint
    assert json.loads(out.read_text())["format"] == "rlkv-head-mask"
    assert "2 layers x 2 KV heads" in capsys.readouterr().out
    bad = parser.parse_args(["export-mask", str(tmp_path), "--out", str(tmp_path / "x.json")])
    assert bad.func(bad) == 2
    assert "no gates.safetensors" in capsys.readouterr().err


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_identical_gate_gradients(reentrant):
    """The paper recipes enable activation checkpointing: it must not change what reaches the gates."""
    ids = torch.randint(0, 300, (2, 40), generator=torch.Generator().manual_seed(0))

    def gate_grad(checkpointing: bool) -> torch.Tensor:
        model = tiny_model("qwen3")
        gates = attach_gates(model, sink=2, local=4, init=0.7)
        model.train()
        if checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.20
                model.activation_checkpointing_enable(
                    activation_checkpointing_kwargs={"use_reentrant": reentrant}
                )
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": reentrant}
                )
        model(ids, use_cache=False).logits.log_softmax(-1).mean().backward()
        return gates.alpha.grad

    plain = gate_grad(False)
    assert plain.abs().min() > 0
    assert torch.equal(gate_grad(True), plain)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("use_vllm", True, "no gates"),
        ("target_sparsity", -0.1, "target_sparsity=-0.1"),
        ("gate_init", 1.5, "gate_init=1.5"),
        ("l1_beta", -1.0, "l1_beta=-1.0"),
        ("gate_local", 0, "gate_local=0 is invalid: use an integer >= 1"),
    ],
)
def test_config_rejects_bad_rlkv_settings(tmp_path, field, value, message):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, **{field: value})
