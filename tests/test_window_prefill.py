"""`window_prefill`: compressed heads attend sink + window in the prompt forward too, query by query.

The reference is an independent implementation of the same attention: the gates' mixed attention
(rlkv/gates/attention.py) with every gate hard at 0 (compressed) or 1 (full), `local = window + 1`
(a gate's local band counts the query itself), over a full cache. This is the form rlkv's vLLM
plugin serves (sink 0), so the vLLM tier compares vLLM against the cache path tested here.
"""

import pytest
import torch

from rlkv import HeadMask
from rlkv.gates import attach_gates
from rlkv.inference import CompressionConfig, CompressionConfigError, generate, make_cache
from rlkv.inference.vllm import matched_compression

pytestmark = pytest.mark.cross_path_floats

PROMPTS = [
    "let x be 3 then x + 4 = 7 and 1 + 2 = 3. 2 * 3 = 6. 4 + 5 = 9. therefore the final answer is",
    "solve the following math problem",
    "wait",
]


def _gated_reference(make_model, family, full_heads, sink, window):
    model = make_model(family)
    gates = attach_gates(model, sink=sink, local=window + 1, init=0.0)
    with torch.no_grad():
        gates.alpha.copy_(full_heads.float())
    return model


@pytest.mark.parametrize("sink", [0, 2])
def test_cache_path_equals_gated_attention_with_hard_gates(make_model, family, tokenizer, sink):
    model = make_model(family)
    mask = HeadMask.random(model, seed=1)
    window = 5
    config = CompressionConfig(
        head_mask=mask, sparsity=0.5, sink=sink, window=window, window_prefill=True, protect_prompt=False
    )
    got = generate(model, tokenizer, PROMPTS, max_new_tokens=24, compression=config, progress=False)
    reference = _gated_reference(make_model, family, config.full_heads(model), sink, window)
    want = generate(reference, tokenizer, PROMPTS, max_new_tokens=24, progress=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the windowed prompt changes what the compressed heads see: a full-prompt prefill gives other tokens
    plain = CompressionConfig(head_mask=mask, sparsity=0.5, sink=sink, window=window, protect_prompt=False)
    other = generate(model, tokenizer, PROMPTS, max_new_tokens=24, compression=plain, progress=False)
    assert [o.token_ids for o in other] != [o.token_ids for o in got]


def test_prompt_logits_equal_the_gated_reference_left_padded(make_model, left_padded_batch):
    ids, attention = left_padded_batch
    model = make_model("qwen2")
    config = matched_compression(HeadMask.random(model, seed=2), 0.5, window=3)
    cache = make_cache(model, config)
    from rlkv.compat import cache_kwargs

    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=attention, **cache_kwargs(cache)).logits
        reference = _gated_reference(make_model, "qwen2", config.full_heads(model), 0, 3)
        want = reference(input_ids=ids, attention_mask=attention).logits
    real = attention.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-4)


def test_matched_compression_is_the_vllm_form(make_model):
    model = make_model("llama")
    config = matched_compression(HeadMask.random(model), 0.75, window=64)
    assert (config.policy, config.sink, config.window, config.window_prefill, config.protect_prompt) == (
        "streaming",
        0,
        64,
        True,
        False,
    )


def test_window_prefill_refuses_other_policies_and_the_static_cache(make_model):
    with pytest.raises(CompressionConfigError, match="window_prefill=True with policy='rkv'"):
        CompressionConfig(policy="rkv", window_prefill=True)
    with pytest.raises(CompressionConfigError, match="window_prefill="):
        CompressionConfig(window_prefill="yes")
    model = make_model("llama")
    config = matched_compression(HeadMask.random(model), 0.5, window=4)
    from rlkv.cache import StaticCacheError

    with pytest.raises(StaticCacheError, match="window_prefill=True has no static form"):
        make_cache(model, config, static=True, max_cache_len=32)
