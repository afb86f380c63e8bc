"""Prefix caching is a pure cache in rlkv's sink/window forms (issue 88): a follow-up request whose prompt holds
an earlier request's output (multi-turn chat, agent loops) gets the tokens of a cold run.

A block whose KV was computed while its request was generating (compressed heads windowed) is not what a cold
run computes for the same tokens as prompt (read in full), so a hit may only reuse blocks written as prompt.
The rings (`rlkv.vllm_plugin.ring`: the eval and protected forms on the platform's kernel) cache no block at all.
"""

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO, engine  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.data.chain_task import load_chain_task  # noqa: E402
from rlkv.data.prompts import build_prompt  # noqa: E402
from rlkv.inference import load  # noqa: E402
from rlkv.inference.vllm import compression_overrides, vllm_compression  # noqa: E402
from rlkv.vllm_plugin.split import CONFIG_KEY  # noqa: E402


def _greedy(llm, ids: list[int], max_tokens: int) -> tuple[list[int], int]:
    """(greedy token ids, prompt tokens served from the prefix cache) of one request."""
    params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


@pytest.mark.parametrize("form", ["eval-form", "eval-form-torch", "protected", "protected-torch"])
def test_a_follow_up_over_an_earlier_output_gets_the_cold_runs_tokens(form):
    model, tokenizer = load(DEMO, dtype="float32")
    protect_prompt = form.startswith("protected")
    overrides = compression_overrides(
        DEMO, vllm_compression(HeadMask.random(model, seed=0), 0.5, window=16, protect_prompt=protect_prompt)
    )
    if form.endswith("torch"):  # rlkv's gather form instead of the ring
        overrides[CONFIG_KEY] = overrides[CONFIG_KEY] | {"kernel": "torch"}
    problems = load_chain_task("test", 2)
    first = tokenizer(build_prompt(problems[0], tokenizer))["input_ids"]
    suffix = tokenizer(" Now solve this one too. " + build_prompt(problems[1], tokenizer))["input_ids"]
    with engine(hf_overrides=overrides, enable_prefix_caching=True) as llm:
        output, _ = _greedy(llm, first, 120)
        follow_up = first + output + suffix
        warm, cached = _greedy(llm, follow_up, 60)
    with engine(hf_overrides=overrides, enable_prefix_caching=False) as llm:
        cold, _ = _greedy(llm, follow_up, 60)
    assert warm == cold
    if not form.endswith("torch"):  # a ring's group caches nothing, so vLLM finds no hit for the model
        assert cached == 0
    else:  # the first request's prompt blocks are still reused (written as prompt: what a cold run computes)
        assert 0 < cached <= len(first), (cached, len(first))
