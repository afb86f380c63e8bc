"""rlkv's head mask in stock vLLM (`rlkv.vllm_plugin`), window-only form: equal tokens, compressed heads'
blocks freed, refusals. (The eval's form, sink + a whole prompt: test_sink_window.py.)

References: stock vLLM for a split with every head full; rlkv's transformers path under the same
semantics (`matched_compression`: streaming, sink 0, windowed prompt) for masked splits. Demo model,
fp32, 48 held-out chain problems, greedy to EOS (200 tokens at most).
"""

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO, REAL, blocks_per_step, engine, greedy, groups_by_kind, kv_groups  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.data.chain_task import load_chain_task, verify_chain  # noqa: E402
from rlkv.data.prompts import build_prompt  # noqa: E402
from rlkv.inference import generate, load  # noqa: E402
from rlkv.inference.vllm import export_vllm_folder, matched_compression, vllm_overrides  # noqa: E402
from rlkv.vllm_plugin.split import CONFIG_KEY, HeadSplitError  # noqa: E402

WINDOW = 64
WINDOW_ONLY = dict(sink=0, window_prefill=True)  # vLLM's own sliding window: sink 0, the prompt windowed
MASK = "results/masks/demo"
SPLIT = {
    "format": 1,
    "full_kv_heads": [[0], [1], [], []],
    "sink": 0,
    "window": 8,
}  # a valid demo split  # the demo's shipped mask, if present; else a seeded random mask


@pytest.fixture(scope="module")
def demo():
    model, tokenizer = load(DEMO, dtype="float32")
    problems = load_chain_task("test", 48)
    prompts = [build_prompt(p, tokenizer) for p in problems]
    mask = HeadMask.from_pretrained(MASK, model) if Path(MASK).is_dir() else HeadMask.random(model, seed=0)
    return model, tokenizer, problems, prompts, mask


def test_every_head_full_gives_stock_vllm_tokens(demo):
    _, _, _, prompts, mask = demo
    with engine() as llm:
        stock = greedy(llm, prompts)
    with engine(hf_overrides=vllm_overrides(DEMO, mask, 0.0, window=WINDOW, **WINDOW_ONLY)) as llm:
        assert llm.llm_engine.model_config.architectures == ["RlkvLlamaForCausalLM"]
        mixed = greedy(llm, prompts)
    assert mixed == stock


@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_masked_tokens_equal_rlkv_transformers_path(demo, sparsity):
    model, tokenizer, problems, prompts, mask = demo
    with engine(hf_overrides=vllm_overrides(DEMO, mask, sparsity, window=WINDOW, **WINDOW_ONLY)) as llm:
        served = greedy(llm, prompts)
    config = matched_compression(mask, sparsity, window=WINDOW)
    reference = generate(
        model, tokenizer, prompts, 200, compression=config, apply_chat_template=False, progress=False
    )
    want = [o.token_ids for o in reference]
    equal = sum(a == b for a, b in zip(served, want))
    assert equal >= 46, f"{equal} of 48 generations equal at s={sparsity}"
    solved = [
        verify_chain(tokenizer.decode(t, skip_special_tokens=True), p["answer"])
        for t, p in zip(served, problems)
    ]
    solved_ref = [verify_chain(o.text, p["answer"]) for o, p in zip(reference, problems)]
    assert abs(sum(solved) - sum(solved_ref)) * 100 / len(problems) <= 1.0
    # the window is real: the same mask with every prompt token visible gives other tokens
    assert prompts and len(tokenizer(prompts[0]).input_ids) > WINDOW + 1


def test_compressed_group_holds_a_constant_window_of_blocks_while_the_full_group_grows(demo):
    _, _, _, _, mask = demo

    with engine(hf_overrides=vllm_overrides(DEMO, mask, 0.5, window=WINDOW, **WINDOW_ONLY)) as llm:
        managers, _ = kv_groups(llm)
        assert len(managers) == 2  # two KV cache groups
        (full_group, window_group), pool = groups_by_kind(llm, "FullAttentionManager", "SlidingWindowManager")
        held = blocks_per_step(llm, (full_group, window_group), [5] * 40, 400)
        assert len(held) >= 399
        full, window, free = zip(*held)
        # a window of 65 tokens spans at most 3 blocks of 32; the full group holds every token
        assert max(window[10:]) <= 3 and min(window[10:]) >= 2
        assert full[0] == 2 and full[-1] == -(-439 // 32)
        # the window group's freed blocks went back to the shared pool: it shrank by the full group's growth only
        assert free[0] - free[-1] <= (full[-1] - full[0]) + 1


def test_prefix_caching_gives_the_same_tokens(demo):
    _, _, _, prompts, mask = demo
    overrides = vllm_overrides(DEMO, mask, 0.5, window=WINDOW, **WINDOW_ONLY)
    with engine(hf_overrides=overrides, enable_prefix_caching=False) as llm:
        plain = greedy(llm, prompts[:8])
    with engine(hf_overrides=overrides, enable_prefix_caching=True) as llm:
        cached = greedy(llm, prompts[:8]) + greedy(llm, prompts[:8])  # the second pass hits the cache
    assert cached == plain + plain


def test_a_prepared_folder_serves_without_overrides(demo, tmp_path):
    _, _, _, prompts, mask = demo
    folder = export_vllm_folder(DEMO, tmp_path / "demo-rlkv", mask, 0.5, window=WINDOW, **WINDOW_ONLY)
    with engine(str(folder)) as llm:
        from_folder = greedy(llm, prompts[:6])
    with engine(hf_overrides=vllm_overrides(DEMO, mask, 0.5, window=WINDOW, **WINDOW_ONLY)) as llm:
        assert greedy(llm, prompts[:6]) == from_folder


@pytest.mark.parametrize(
    "split, message",
    [
        ({"full_kv_heads": [[0]]}, "full_kv_heads has 1 layers, the model 4"),
        ({"prompt": "all"}, "prompt='all': must be 'full'"),
    ],
)
def test_engine_start_refuses_a_split_that_does_not_fit(split, message):
    overrides = {"architectures": ["RlkvLlamaForCausalLM"], CONFIG_KEY: SPLIT | split}
    with pytest.raises(Exception) as failure, engine(hf_overrides=overrides):
        pass
    chain = [failure.value, *_causes(failure.value)]
    assert any(isinstance(e, HeadSplitError) and message in str(e) for e in chain), chain


def test_engine_start_refuses_lora_adapters_in_the_stock_head_order():
    """The plugin serves each layer's heads permuted (full first); a LoRA adapter's q/k/v/o deltas are in the
    stock order, so adapters are refused at engine start with the fix (merge them)."""
    overrides = {"architectures": ["RlkvLlamaForCausalLM"], CONFIG_KEY: SPLIT}
    with pytest.raises(Exception) as failure, engine(hf_overrides=overrides, enable_lora=True):
        pass
    chain = [failure.value, *_causes(failure.value)]
    assert any(isinstance(e, HeadSplitError) and "merge the adapter" in str(e) for e in chain), chain


def _causes(error):
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
        yield error


def test_a_mask_of_another_model_is_refused_before_vllm_starts(make_model):
    other = HeadMask.random(make_model("llama"))
    from rlkv.head_mask import HeadMaskError

    with pytest.raises(HeadMaskError):
        vllm_overrides(DEMO, other, 0.5)


@pytest.mark.skipif(not Path(REAL).is_dir(), reason=f"{REAL} is absent: make model")
def test_real_model_every_head_full_gives_stock_tokens():
    model, tokenizer = load(REAL, dtype="float32")
    prompts = [
        build_prompt(f"What is {a} + {b}? Explain.", tokenizer) for a, b in zip(range(8), range(10, 18))
    ]
    mask = HeadMask.random(model, seed=0)
    with engine(REAL, max_model_len=512) as llm:
        stock = greedy(llm, prompts, 64)
    with engine(REAL, max_model_len=512, hf_overrides=vllm_overrides(REAL, mask, 0.0)) as llm:
        assert greedy(llm, prompts, 64) == stock
