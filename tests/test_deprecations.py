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
