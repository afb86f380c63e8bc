"""The eviction group on vLLM's own CPU attention kernel (`rlkv.vllm_plugin.eviction_stock`): eviction as a
prefix of the slot space, read by one stock paged call; the torch form (`kernel: "torch"`) is the exact
reference. Demo model, fp32, greedy, 48 held-out problems."""

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

import torch  # noqa: E402
from vllm_engines import demo_chain, engine, greedy, model_runner, solved  # noqa: E402

from rlkv.eval.methods import method_config  # noqa: E402
from rlkv.inference.vllm import compression_overrides  # noqa: E402
from rlkv.vllm_plugin.eviction import PLAIN_CPU_ISAS  # noqa: E402
from rlkv.vllm_plugin.split import CONFIG_KEY  # noqa: E402


@pytest.fixture(scope="module")
def demo():
    return demo_chain()


@pytest.mark.parametrize("isa", PLAIN_CPU_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_page_views_read_and_write_the_slots_the_stock_cache_write_uses(isa, dtype):
    """What vLLM's CPU cache write stores at a slot, `cpu_attn_pages` reads there (keys transposed per block,
    values plain); what it writes there, the stock kernel attends."""
    from vllm import _custom_ops as ops

    from rlkv.vllm_plugin.eviction_stock import cpu_attn_pages

    blocks, heads, size, d = 4, 2, 32, 64
    cache = torch.zeros(blocks, heads, size, 2 * d, dtype=dtype)
    key, value = torch.randn(6, heads, d).to(dtype), torch.randn(6, heads, d).to(dtype)
    slots = torch.tensor([0, 33, 70, 95, 40, 127])
    key_cache, value_cache = cache.view(blocks, heads, 2 * size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0)
    pages = cpu_attn_pages(cache)
    assert torch.equal(pages.keys[slots // size, :, slots % size], key)
    assert torch.equal(pages.values[slots // size, :, slots % size], value)
    # a move through the views (a compaction's) lands where the stock write would have put it
    moved = cache.clone()
    moved_pages = cpu_attn_pages(moved)
    moved_pages.keys[slots // size, :, slots % size] = key.flip(0)
    moved_pages.values[slots // size, :, slots % size] = value.flip(0)
    expected = torch.zeros_like(cache)
    key_cache, value_cache = expected.view(blocks, heads, 2 * size, d).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key.flip(0), value.flip(0), key_cache, value_cache, slots, isa, k_scale=1.0, v_scale=1.0
    )
    assert torch.equal(moved, expected)


def _overrides(model, mask, method, sparsity, kernel):
    config = method_config(method, sparsity, model=model, masks={"rlkv": mask})
    overrides = compression_overrides(model.config, config)
    return overrides | {CONFIG_KEY: overrides[CONFIG_KEY] | {"kernel": kernel}}


def _eviction_backends(llm) -> set[str]:
    return {
        m.attn_backend.get_name()
        for m in model_runner(llm).model.modules()
        if type(m).__name__ == "EvictionAttention"
    }


@pytest.mark.parametrize(
    ("method", "sparsity"), [("rlkv+rkv", 0.5), ("rlkv+rkv", 0.75), ("rkv", 0.5)], ids=str
)
def test_the_stock_kernel_gives_the_torch_forms_tokens(demo, method, sparsity):
    """R-KV at buffer 0 (a compaction every step once over budget: the prefix moves every step)."""
    model, tokenizer, problems, prompts, mask = demo
    with engine(hf_overrides=_overrides(model, mask, method, sparsity, "torch")) as llm:
        assert _eviction_backends(llm) == {"RLKV_EVICTION"}
        reference = greedy(llm, prompts)
    with engine(hf_overrides=_overrides(model, mask, method, sparsity, "stock")) as llm:
        assert _eviction_backends(llm) == {"RLKV_EVICTION_CPU_ATTN"}
        served = greedy(llm, prompts)
    equal = sum(a == b for a, b in zip(served, reference))
    assert equal >= 46, f"{equal} of 48 generations equal"
    ours, _ = solved(tokenizer, problems, served, [])
    theirs, _ = solved(tokenizer, problems, reference, [])
    assert abs(ours - theirs) <= 2, (ours, theirs)


def test_the_compiled_path_gives_the_eager_tokens_and_h2o_keeps_the_torch_form(demo):
    """vLLM started without `enforce_eager` (its compiled path; the attention stays an opaque custom op) gives
    the eager tokens; H2O needs the attention each slot gets, which the stock kernel does not return."""
    model, _, _, prompts, mask = demo
    overrides = _overrides(model, mask, "rlkv+rkv", 0.5, "stock")
    with engine(hf_overrides=overrides) as llm:
        eager = greedy(llm, prompts[:16])
    with engine(hf_overrides=overrides, enforce_eager=False) as llm:
        compiled = greedy(llm, prompts[:16])
    assert sum(a == b for a, b in zip(eager, compiled)) >= 15
    with engine(hf_overrides=_overrides(model, mask, "rlkv+h2o", 0.5, "stock")) as llm:
        assert _eviction_backends(llm) == {"RLKV_EVICTION"}


def test_four_kv_heads_uneven_parts_give_the_torch_forms_and_the_transformers_paths_tokens(
    tmp_path, make_model
):
    """A tiny model with 4 KV heads and a random mask (uneven per-layer counts: parts of one KV head, some not
    contiguous), R-KV at a budget of 32 so that every request compacts, 60 greedy tokens on 12 prompts."""
    import dataclasses

    from vllm import SamplingParams

    from rlkv import HeadMask
    from rlkv.data.chain_task import load_chain_task
    from rlkv.inference import generate
    from rlkv.testing import tiny_tokenizer
    from rlkv.vllm_plugin.fence import eviction_compactions

    model = make_model("llama", num_key_value_heads=4, num_attention_heads=8, head_dim=32, hidden_size=128)
    tokenizer = tiny_tokenizer()  # head_dim 32: vLLM's CPU kernel needs a multiple of 32
    model.save_pretrained(tmp_path / "tiny")
    mask = HeadMask.random(model, seed=3)
    config = method_config("rlkv+rkv", 0.5, model=model, masks={"rlkv": mask})
    config = dataclasses.replace(config, budget=32)
    prompts = [p["problem"] for p in load_chain_task("test", 12)]
    ids = [tokenizer(p).input_ids for p in prompts]
    served = {}
    for kernel in ("stock", "torch"):
        overrides = compression_overrides(model.config, config)
        overrides = overrides | {CONFIG_KEY: overrides[CONFIG_KEY] | {"kernel": kernel}}
        with engine(str(tmp_path / "tiny"), hf_overrides=overrides, skip_tokenizer_init=True) as llm:
            assert (
                _eviction_backends(llm)
                == {"stock": {"RLKV_EVICTION_CPU_ATTN"}, "torch": {"RLKV_EVICTION"}}[kernel]
            )
            params = SamplingParams(temperature=0, max_tokens=60, detokenize=False)
            outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
            served[kernel] = [list(o.outputs[0].token_ids) for o in outs]
            assert min(eviction_compactions(llm)) >= 12  # every request compacted
    reference = generate(
        model, tokenizer, prompts, 60, compression=config, apply_chat_template=False, progress=False
    )
    assert sum(a == b for a, b in zip(served["stock"], served["torch"])) >= 11
    equal = sum(a == o.token_ids for a, o in zip(served["stock"], reference))
    assert equal >= 11, f"{equal} of 12 equal"
