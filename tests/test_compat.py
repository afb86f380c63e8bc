"""The fence around private TRL / transformers API: checked at construction, one named error."""

import importlib.metadata
import warnings

import pytest
import torch
import trl
from datasets import Dataset
from trl import GRPOTrainer

from rlkv.compat import (
    COMPRESSED_ROLLOUT_API,
    GATE_TRAINER_API,
    PrivateAPI,
    UnsupportedVersionError,
    cache_kwargs,
    check_attributes,
    check_private_api,
    forward_cache,
    generate_cache_kwargs,
    supported_range,
)
from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts


def test_installed_trl_and_transformers_pass_the_fence():
    check_private_api(GRPOTrainer, GATE_TRAINER_API)
    check_private_api(GRPOTrainer, COMPRESSED_ROLLOUT_API)


def test_declared_ranges_come_from_the_package_metadata():
    requires = " ".join(importlib.metadata.requires("rlkv"))
    assert supported_range("trl") in requires and supported_range("transformers") in requires
    assert ">=" in supported_range("trl") and "<" in supported_range("trl")  # a tested range, not any trl


def test_a_changed_signature_is_named_with_the_supported_range():
    # TRL 1.10's rollout method took other arguments; the fence names it instead of a TypeError mid-step
    old = PrivateAPI(methods={"_generate_single_turn": ("prompts", "images")})
    with pytest.raises(UnsupportedVersionError) as err:
        check_private_api(GRPOTrainer, old, feature="compressed rollouts")
    text = str(err.value)
    assert "GRPOTrainer._generate_single_turn" in text and "(prompts, images)" in text
    assert f"trl {trl.__version__}" in text and supported_range("trl") in text
    assert "compressed rollouts" in text


def test_missing_methods_attributes_and_helpers_are_named():
    api = PrivateAPI(
        methods={"_no_such_method": ("inputs",)},
        attributes=("_no_such_attribute",),
        helpers=("trl.trainer.utils:no_such_helper",),
    )
    with pytest.raises(UnsupportedVersionError) as err:
        check_private_api(GRPOTrainer, api)
    assert "_no_such_method" in str(err.value) and "trl.trainer.utils.no_such_helper" in str(err.value)
    with pytest.raises(UnsupportedVersionError, match="'_no_such_attribute'"):
        check_attributes(object(), api)


def test_trainers_check_the_fence_before_trl_runs(tmp_path, make_model, tokenizer):
    """A TRL whose rollout method has another signature (a subclass standing in for another TRL
    release) is refused by the rlkv constructor, before TRL's own __init__ does any work."""

    class OtherTRL(GRPOTrainer):
        def _generate_single_turn(self, prompts):  # the shape of an older TRL
            raise AssertionError("never reached")

    OtherTRL.__module__ = "trl.trainer.grpo_trainer"
    with pytest.raises(UnsupportedVersionError, match="_generate_single_turn"):
        with_compressed_rollouts(OtherTRL)(
            model=make_model("llama"),
            args=None,
            reward_funcs=lambda completions, **kw: [0.0] * len(completions),
            train_dataset=Dataset.from_list([{"prompt": "hi"}]),
            processing_class=tokenizer,
            rollout_compression=CompressedRolloutConfig(sparsity=0.5),
        )


def test_forward_cache_reads_the_cache_under_either_name(make_model):
    """transformers 5.24 renamed the forward argument past_key_values to cache: hooks see both."""
    from transformers import DynamicCache

    model = make_model("llama")
    seen = []
    model.register_forward_pre_hook(lambda m, a, kw: seen.append(forward_cache(kw)), with_kwargs=True)
    cache = DynamicCache(config=model.config)
    model(input_ids=torch.tensor([[1, 2, 3]]), **cache_kwargs(cache), use_cache=True)
    with warnings.catch_warnings():  # the old name on purpose: 5.24 maps it (and warns)
        warnings.simplefilter("ignore", FutureWarning)
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=cache, use_cache=True)
    assert seen == [cache, cache]
    assert forward_cache({"cache": cache}) is cache and forward_cache({}) is None


def test_generate_and_forward_get_the_user_cache_without_a_deprecation_warning(make_model):
    """generate and a forward fill the cache handed over by cache_kwargs, under the installed version's name."""
    from transformers import DynamicCache

    model = make_model("llama")
    cache = DynamicCache(config=model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model.generate(
            input_ids=torch.tensor([[1, 2, 3]]),
            max_new_tokens=4,
            do_sample=False,
            **cache_kwargs(cache),
        )
        assert cache.get_seq_length() == 3 + 4 - 1  # the last sampled token is never fed back
        model(input_ids=torch.tensor([[5]]), **cache_kwargs(cache), use_cache=True)
    assert cache.get_seq_length() == 3 + 4


def test_the_old_name_of_cache_kwargs_warns_and_gives_the_same_dict():
    cache = object()
    with pytest.warns(FutureWarning, match=r"generate_cache_kwargs is deprecated.*cache_kwargs"):
        assert generate_cache_kwargs(cache) == cache_kwargs(cache)


def test_pytest_turns_the_transformers_cache_rename_warning_into_an_error(make_model):
    """pyproject's filterwarnings: a call site passing `past_key_values=` fails the suite on transformers >= 5.24."""
    from transformers import DynamicCache

    if "cache" not in cache_kwargs(None):
        pytest.skip("transformers < 5.24 has no cache argument to rename to")
    model = make_model("llama")
    with pytest.raises(FutureWarning, match="`past_key_values` is deprecated"):
        model(input_ids=torch.tensor([[1, 2, 3]]), past_key_values=DynamicCache(config=model.config))


def test_private_cpu_flash_op_is_checked_against_public_sdpa():
    from rlkv.compat import check_flash_with_lse, cpu_flash_attention_with_lse

    op = cpu_flash_attention_with_lse()
    assert op is not None  # torch 2.13 CPU has it; the split decode relies on it
    check_flash_with_lse(op)  # passes as is

    def wrong_lse(q, k, v, scale):  # an op whose log-sum-exp changed base
        out, lse = op(q, k, v, scale=scale)
        return out, lse / torch.log(torch.tensor(2.0))

    def wrong_signature(q, k, v, scale):
        return op(q, k, v, 0.0, False, None, scale)

    with pytest.raises(UnsupportedVersionError, match="log-sum-exp differs"):
        check_flash_with_lse(wrong_lse)
    with pytest.raises(UnsupportedVersionError, match="TypeError|RuntimeError"):
        check_flash_with_lse(wrong_signature)
