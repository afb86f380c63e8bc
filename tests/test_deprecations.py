"""Public names removed or renamed keep working for at least one minor release, with a FutureWarning
naming the replacement (CONTRIBUTING.md, "Other changes")."""

from __future__ import annotations

import pytest
import torch

from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache


def test_head_mixed_cache_logical_length_warns_and_returns_get_seq_length(make_model):
    model = make_model("qwen2")
    cache = make_cache(model, CompressionConfig(policy="streaming", sink=2, window=4, head_mask=None))
    with torch.no_grad():
        model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), **cache_kwargs(cache))
        model(input_ids=torch.tensor([[8]]), **cache_kwargs(cache))
    with pytest.warns(FutureWarning, match=r"logical_length\(\) is deprecated.*get_seq_length\(\)"):
        assert cache.logical_length() == cache.get_seq_length() == 8
    # the layers' attribute of the same name (read by the attention and the policies) is untouched
    assert [layer.logical_length for layer in cache.layers] == [8] * len(cache.layers)


def test_mask_from_order_warns_and_builds_the_mask_from_order(make_model):
    """`rlkv.eval.sensitivity.mask_from_order` moved to `HeadMask.from_order` (issue 77: the ablation room
    no longer reaches into eval)."""
    from rlkv import HeadMask
    from rlkv.eval import sensitivity

    model = make_model("qwen2")
    mask = HeadMask.random(model, seed=3)
    with pytest.warns(FutureWarning, match=r"mask_from_order is deprecated.*HeadMask.from_order"):
        old = sensitivity.mask_from_order(mask.order(), model, method="x")
    new = HeadMask.from_order(mask.order(), model, method="x")
    assert torch.equal(old.scores, new.scores) and old.metadata == new.metadata == {"method": "x"}
    assert torch.equal(new.order(), mask.order())


def test_vllm_engines_warns_and_is_the_vllm_runner():
    """`VLLMEngines` was one letter from `rlkv.rollout.VLLMEngine` (issue 77): renamed `VLLMRunner`."""
    from rlkv.inference import vllm_engine

    with pytest.warns(FutureWarning, match=r"VLLMEngines is deprecated.*use VLLMRunner"):
        assert vllm_engine.VLLMEngines is vllm_engine.VLLMRunner


def test_the_verifiers_old_module_paths_warn_and_give_the_moved_names():
    """`rlkv.data.verify` / `rlkv.data.answers` moved to the `rlkv.verifiers` room (issue 77); `from rlkv.data
    import verify` stays the function."""
    import importlib

    import rlkv.data
    import rlkv.verifiers

    verify, answers = (importlib.import_module(f"rlkv.verifiers.{m}") for m in ("verify", "answers"))

    assert rlkv.data.verify is rlkv.verifiers.verify and callable(rlkv.data.verify)
    with pytest.warns(
        FutureWarning, match=r"rlkv.data.verify.run_python_tests is deprecated.*rlkv.verifiers"
    ):
        from rlkv.data.verify import run_python_tests
    assert run_python_tests is verify.run_python_tests
    with pytest.warns(FutureWarning, match=r"rlkv.data.answers.extract_boxed is deprecated"):
        from rlkv.data.answers import extract_boxed
    assert extract_boxed is answers.extract_boxed
    assert extract_boxed(r"so \boxed{42}.") == "42"
