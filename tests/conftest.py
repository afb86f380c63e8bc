"""Shared fixtures: tiny random models of the real architectures and an offline tokenizer (no network)."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from rlkv.testing import FAMILIES, tiny_model, tiny_tokenizer  # noqa: E402

torch.set_num_threads(1)


def pytest_configure(config):
    # registered here, not in pyproject.toml: the Makefile reinstalls the venv whenever pyproject changes
    config.addinivalue_line(
        "markers",
        "cross_path_floats: compares floats computed along different code paths, shapes or capacities "
        "(with a stated tolerance); .ci/run runs these again under ATEN_CPU_CAPABILITY=default",
    )


TESTED_FAMILIES = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="session")
def tokenizer():
    return tiny_tokenizer()


@pytest.fixture(params=TESTED_FAMILIES)
def family(request):
    return request.param


@pytest.fixture
def model(family):
    return tiny_model(family)


@pytest.fixture
def make_model():
    """Factory: make_model(family="llama", seed=0, **config_overrides)."""
    return tiny_model


@pytest.fixture
def left_padded_batch(tokenizer):
    """Four prompts of different lengths, left-padded: (input_ids[4, T], attention_mask[4, T])."""
    prompts = [
        "let x be 3 then x + 4 = 7",
        "solve the following math problem",
        "1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is boxed",
        "wait",
    ]
    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


__all__ = ["FAMILIES"]


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """Trainers set torch's thread count (GateGRPOConfig.torch_threads); keep the suite on one thread."""
    yield
    torch.set_num_threads(1)
