"""Method names -> CompressionConfig, and the matched-budget arithmetic."""

import pytest

from rlkv.eval.methods import (
    BudgetRule,
    MethodError,
    baseline_sizing,
    effective_sparsity,
    matched_tokens_per_head,
    method_config,
    parse_method,
    random_mask_seed,
)
from rlkv.head_mask import HeadMask
from rlkv.inference import CompressionConfig


def test_parse_method_forms():
    assert parse_method("full").is_full
    assert (parse_method("rlkv").mask, parse_method("rlkv").policy) == ("rlkv", "streaming")
    assert (parse_method("rlkv+h2o").mask, parse_method("rlkv+h2o").policy) == ("rlkv", "h2o")
    assert (parse_method("h2o").mask, parse_method("h2o").policy) == (None, "h2o")
    assert parse_method("streaming").policy == "sink-recent"
    with pytest.raises(MethodError, match="registered policies"):
        parse_method("nope")
    with pytest.raises(MethodError):
        parse_method("foo+h2o")


def test_seeded_random_mask_methods():
    assert (parse_method("random-mask@3").mask, parse_method("random-mask@3").policy) == (
        "random-mask@3",
        "streaming",
    )
    assert (parse_method("random-mask@12+rkv").mask, parse_method("random-mask@12+rkv").policy) == (
        "random-mask@12",
        "rkv",
    )
    assert random_mask_seed("random-mask@12") == 12 and random_mask_seed("random-mask") is None
    for bad in ("random-mask@", "random-mask@x", "rlkv@1", "random-mask@-1"):
        with pytest.raises(MethodError, match="random-mask@<seed>"):
            parse_method(bad)


def test_seeded_random_masks_are_built_per_seed(make_model):
    from rlkv.eval.runner import EvalConfig, build_masks

    model = make_model("qwen2")
    cfg = EvalConfig(
        model="tiny:qwen2",
        methods=["full", "random-mask", "random-mask@1", "random-mask@2+rkv"],
        random_mask_seed=1,
    )
    masks = build_masks(cfg, model)
    assert set(masks) == {"random-mask", "random-mask@1", "random-mask@2"}
    assert masks["random-mask@1"].scores.equal(HeadMask.random(model, seed=1).scores)
    assert masks["random-mask@1"].scores.equal(masks["random-mask"].scores)  # random_mask_seed=1
    assert not masks["random-mask@2"].scores.equal(masks["random-mask@1"].scores)


@pytest.mark.parametrize("num_heads", [4, 7, 28 * 4, 32 * 8])
@pytest.mark.parametrize("sparsity", [0.0, 0.2, 0.4, 0.5, 0.6, 0.8, 1.0])
def test_matched_baseline_budget_equals_head_mask_kv_within_one_token(num_heads, sparsity):
    rule = BudgetRule()
    sizing = baseline_sizing(sparsity, num_heads, rule)
    n_full = round((1 - sparsity) * num_heads)
    for length in range(rule.overhead, 5000, 53):
        # head-mask method: n_full heads hold every token, the others sink + window
        mask_tokens = (n_full * length + (num_heads - n_full) * rule.overhead) / num_heads
        budget = sizing["budget"]
        # the cache's budget: round(ratio * length) + sink + window, or an int
        per_head = (
            budget if isinstance(budget, int) else round(budget * length) + sizing["sink"] + sizing["window"]
        )
        per_head = min(per_head, length)
        assert abs(per_head - mask_tokens) <= 1.0
        assert matched_tokens_per_head(sparsity, num_heads, length, rule.overhead) == pytest.approx(
            mask_tokens
        )


def test_paper_and_fixed_rules():
    paper = baseline_sizing(0.6, 40, BudgetRule(kind="paper"))
    assert paper == {"budget": pytest.approx(0.4), "sink": 16, "window": 64}
    fixed = baseline_sizing(0.6, 40, BudgetRule(kind="fixed", fixed_budget=1024))
    assert fixed == {"budget": 1024, "sink": 16, "window": 64}
    with pytest.raises(MethodError, match="fixed_budget"):
        BudgetRule(kind="fixed")
    with pytest.raises(MethodError, match="budget_rule"):
        BudgetRule(kind="nope")
    assert effective_sparsity(0.2, 4) == pytest.approx(0.25)


def test_method_config_fields():
    from rlkv.testing import tiny_model

    model = tiny_model("llama")
    mask = HeadMask.random(model, seed=1)
    assert method_config("full", 0.5, model=model, masks={}) is None
    rlkv = method_config("rlkv", 0.5, model=model, masks={"rlkv": mask})
    assert isinstance(rlkv, CompressionConfig)
    assert (rlkv.policy, rlkv.sink, rlkv.window, rlkv.protect_prompt) == ("streaming", 16, 64, False)
    assert rlkv.full_heads(model).sum() == 2
    combo = method_config(
        "rlkv+h2o", 0.5, model=model, masks={"rlkv": mask}, policy_kwargs={"h2o": {"recent_ratio": 0.3}}
    )
    assert (combo.policy, combo.budget, combo.sink, combo.window) == ("h2o", 80, 16, 8)
    assert combo.policy_kwargs == {"recent_ratio": 0.3}
    base = method_config("h2o", 0.5, model=model, masks={})
    assert base.head_mask is None and base.budget == pytest.approx(0.5) and base.sink + base.window == 40
    with pytest.raises(MethodError, match="head_mask"):
        method_config("rlkv", 0.5, model=model, masks={})


def test_matched_rule_turns_buffers_off_also_through_subclass_kwargs(tokenizer):
    from rlkv.testing import tiny_model

    model = tiny_model("llama")
    rkv = method_config("rkv", 0.5, model=model, masks={})
    assert rkv.policy_kwargs == {"buffer": 0}
    skipkv = method_config("skipkv", 0.5, model=model, masks={}, tokenizer=tokenizer)  # SkipKV(**rkv_kwargs)
    assert skipkv.policy_kwargs["buffer"] == 0 and skipkv.policy_kwargs["tokenizer"] is tokenizer
    paper = method_config("rkv", 0.5, model=model, masks={}, rule=BudgetRule(kind="paper"))
    assert paper.policy_kwargs == {}
    mine = method_config("rkv", 0.5, model=model, masks={}, policy_kwargs={"rkv": {"buffer": 4}})
    assert mine.policy_kwargs == {"buffer": 4}


def test_window_prefill_windows_the_prompt_of_the_head_mask_methods_with_their_sink(make_model):
    from rlkv.eval import EvalConfig

    model = make_model("llama")
    masks = {"rlkv": HeadMask.random(model, seed=0)}
    rule = EvalConfig(model="tiny:llama", methods=["full"], window_prefill=True).budget()
    config = method_config("rlkv", 0.5, model=model, masks=masks, rule=rule)
    assert (config.sink, config.window, config.window_prefill, config.protect_prompt) == (16, 64, True, False)
    assert not method_config(
        "rlkv", 0.5, model=model, masks=masks
    ).window_prefill  # the eval's form by default
    with pytest.raises(ValueError, match="protect_prompt=True with window_prefill=True"):
        EvalConfig(model="tiny:llama", methods=["full"], window_prefill=True, protect_prompt=True)
    with pytest.raises(ValueError, match="window_only is already windowed"):
        EvalConfig(model="tiny:llama", methods=["full"], window_prefill=True, window_only=True)
