"""Rollout sampling by the exponential race: the model's distribution, transformers' warpers, no leaks."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from rlkv.testing import tiny_model
from rlkv.trainers import GateGRPOTrainer
from rlkv.trainers.sampling import ExponentialRaceSampler, race_processors, rollout_generation
from tests.test_trainer import config, prompts_dataset, token_reward

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])


def draw_frequencies(processors, draws: int = 60000) -> torch.Tensor:
    torch.manual_seed(0)
    scores = processors(None, LOGITS.expand(draws, -1).clone())
    return torch.bincount(scores.argmax(-1), minlength=LOGITS.numel()).float() / draws


def test_race_draws_the_softmax_distribution_and_leaves_its_input_alone():
    scores = LOGITS.expand(4, -1).clone()
    ExponentialRaceSampler()(None, scores)
    assert torch.equal(scores, LOGITS.expand(4, -1))  # transformers may keep it as the raw logits
    freq = draw_frequencies(ExponentialRaceSampler())
    # 60000 draws: one standard deviation of a frequency is at most 0.002
    torch.testing.assert_close(freq, LOGITS.softmax(-1), atol=0.01, rtol=0)


def test_race_applies_temperature_and_top_k_as_transformers_sampling_does():
    procs = race_processors(GenerationConfig(do_sample=True, temperature=0.5, top_k=3, top_p=1.0))
    expected = torch.zeros_like(LOGITS)
    expected[:3] = (LOGITS[:3] / 0.5).softmax(-1)
    torch.testing.assert_close(draw_frequencies(procs), expected, atol=0.01, rtol=0)


def test_generate_under_race_sampling_equals_hand_written_race_decoding():
    """The model's own generation_config (sampling, top-k 3, T 0.3) must not leak into the greedy copy."""
    model = tiny_model("qwen2")
    model.generation_config.do_sample, model.generation_config.top_k = True, 3
    model.generation_config.temperature = 0.3
    ids = torch.randint(3, 60, (2, 5), generator=torch.Generator().manual_seed(1))
    cfg = GenerationConfig(
        max_new_tokens=6, do_sample=True, temperature=0.8, top_k=0, top_p=1.0, pad_token_id=0
    )
    torch.manual_seed(0)
    with rollout_generation(model, cfg, eos_token_ids=[]) as greedy:
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=greedy)[:, 5:]
    assert "generate" not in vars(model)

    torch.manual_seed(0)
    seq = ids
    with torch.no_grad():
        for _ in range(6):
            logits = model(seq).logits[:, -1].float() / 0.8
            seq = torch.cat([seq, ExponentialRaceSampler()(seq, logits).argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq[:, 5:])


@pytest.mark.parametrize(
    "cfg",
    [GenerationConfig(do_sample=False), GenerationConfig(do_sample=True, typical_p=0.9)],
    ids=["greedy", "typical_p"],
)
def test_race_sampling_leaves_what_it_does_not_rebuild_to_transformers(cfg):
    model = tiny_model("llama")
    with rollout_generation(model, cfg, eos_token_ids=[0]) as used:
        assert used is cfg and vars(model)["generate"].args[2] is None  # no processors of ours
    assert "generate" not in vars(model)


def test_trainer_rollouts_use_the_race_and_restore_the_sampling_config(tmp_path, tokenizer):
    trainer = GateGRPOTrainer(
        model=tiny_model("llama"),
        reward_funcs=token_reward,
        args=config(tmp_path, max_steps=1),
        train_dataset=prompts_dataset(),
        processing_class=tokenizer,
    )
    model = trainer.model
    installed = []  # what model.generate was at each forward (our partial, with the race's processors)
    model.register_forward_pre_hook(lambda module, args: installed.append(vars(module).get("generate")))
    trainer.train()
    rollout = [g for g in installed if g is not None]
    assert rollout, "no forward ran under race sampling"
    assert all(isinstance(g.args[2][-1], ExponentialRaceSampler) for g in rollout)
    assert all(g.args[1] == tuple(trainer.eos_token_ids) for g in rollout)  # row ends read on the host
    assert trainer.generation_config.do_sample and "generate" not in vars(model)
