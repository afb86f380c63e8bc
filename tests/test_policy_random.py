"""Random token eviction: uniform priorities, no recency bias, the prompt kept, seeded, matched budgets."""

import pytest
import torch

from rlkv.compat import cache_kwargs
from rlkv.eval.methods import method_config, parse_method
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig, make_cache
from rlkv.policies import get_policy
from rlkv.policies.random_evict import random_priorities
from rlkv.testing import tiny_model


def test_priorities_are_uniform_and_independent_across_heads_and_seeds():
    rel = torch.arange(40_000).view(1, 1, -1).expand(1, 2, -1)
    prio = random_priorities(0, 3, torch.tensor([0, 1]), rel)
    assert prio.min() >= 0 and prio.max() < 2**24
    counts = torch.histc(prio[0, 0], bins=20, min=0, max=2**24)
    expected = rel.shape[-1] / 20
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 43.8  # 19 degrees of freedom, p = 0.001
    # heads, seeds and layers draw differently (correlation near 0), the same inputs the same values
    other_seed = random_priorities(1, 3, torch.tensor([0, 1]), rel)
    other_layer = random_priorities(0, 4, torch.tensor([0, 1]), rel)
    for a, b in [(prio[0, 0], prio[0, 1]), (prio[0, 0], other_seed[0, 0]), (prio[0, 0], other_layer[0, 0])]:
        assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.03
    assert torch.equal(prio, random_priorities(0, 3, torch.tensor([0, 1]), rel))


def _config(budget: int, **policy_kwargs) -> CompressionConfig:
    """Every head compressed by `random` (sink 1, window 2, the prompt unprotected) at an int budget."""
    return CompressionConfig(
        head_mask=None,
        policy="random",
        policy_kwargs=policy_kwargs,
        budget=budget,
        sink=1,
        window=2,
        protect_prompt=False,
    )


def _kept_positions(config: CompressionConfig, ids, mask, new_tokens: int) -> list[list[list[int]]]:
    model = tiny_model("llama")
    cache = make_cache(model, config)
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        **cache_kwargs(cache),
    )
    out = []
    for layer in cache.layers:
        if layer.store is not None:
            out.append(
                [
                    [sorted(p for p in head if p >= 0) for head in row]
                    for row in layer.store.positions.tolist()
                ]
            )
    return out


def test_the_prompt_stays_and_the_rest_is_a_sample_without_recency_bias():
    """Budget 24 of 8 prompt + 100 generated tokens, sink 1 + window 2: every prompt token stays; the
    other kept tokens spread over the whole generation (half of them in each half, within sampling
    error), unlike a recency policy; seeds draw different samples."""
    ids = torch.randint(3, 300, (1, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    early = late = 0
    samples = []
    for seed in range(3):
        kept = _kept_positions(_config(24, seed=seed), ids, mask, 100)
        samples.append(kept)
        for layer in kept:
            for head in layer[0]:
                assert len(head) == 24 and set(range(8)) <= set(head)  # the prompt kept
                sampled = [p for p in head if 8 <= p < 105]  # neither prompt nor window
                early += sum(p < 57 for p in sampled)
                late += sum(p >= 57 for p in sampled)
    total = early + late
    assert total > 0 and abs(early - late) < 4 * (total**0.5)  # no recency bias (4 sigma)
    assert samples[0] != samples[1] != samples[2]  # each seed its own draw


def test_keep_prompt_false_samples_the_prompt_too():
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(1))
    kept = _kept_positions(_config(16, keep_prompt=False), ids, torch.ones_like(ids), 20)
    assert any(not set(range(40)) <= set(head) for layer in kept for head in layer[0])


@pytest.mark.parametrize("bad", [{"seed": -1}, {"seed": 1.5}, {"seed": True}])
def test_bad_seed_is_one_clear_error(bad):
    with pytest.raises(ValueError, match="random: seed="):
        get_policy("random", **bad)


def test_eval_methods_random_evict_alone_and_with_a_mask():
    model = tiny_model("llama")
    assert parse_method("random-evict").policy == "random"
    assert parse_method("rlkv+random-evict").policy == "random"
    assert parse_method("rlkv+streaming").policy == "streaming"  # the alias is random-evict's only
    baseline = method_config("random-evict", 0.5, model=model, masks={})
    mask = HeadMask.random(model, seed=0)
    combo = method_config("rlkv+random-evict", 0.5, model=model, masks={"rlkv": mask})
    assert baseline.policy == combo.policy == "random" and baseline.head_mask is None
    assert combo.head_mask is mask and combo.budget == 80  # the compressed heads' matched count
