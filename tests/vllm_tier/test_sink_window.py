"""rlkv's own form on vLLM (`rlkv.vllm_plugin.sink_window`, and `ring` for the eval form on the platform's own
kernel): compressed heads keep sink + window tokens, the prompt read in full, in a KV cache group of their
own whose freed blocks go back to vLLM's pool.

References: rlkv's transformers path with the same `CompressionConfig` (policy streaming, sink 16, window
64, `protect_prompt=False`; `window_prefill` False = the eval's form, True = the windowed prompt); stock
vLLM where the window covers every position. Demo model (2 KV heads) and a random tiny Llama with 4 KV
heads (every path of the head split: non-contiguous parts), fp32, greedy.
"""

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import blocks_per_step, demo_chain, engine, greedy, groups_by_kind, kv_groups, solved  # noqa: E402

from rlkv import HeadMask  # noqa: E402
from rlkv.data.chain_task import load_chain_task  # noqa: E402
from rlkv.inference import generate  # noqa: E402
from rlkv.inference.vllm import compression_overrides, vllm_compression  # noqa: E402
from rlkv.vllm_plugin.split import CONFIG_KEY  # noqa: E402

SINK, WINDOW, BLOCK = 16, 64, 32


@pytest.fixture(scope="module")
def demo():
    return demo_chain()


def _form(mask, sparsity, window_prefill=False, window=WINDOW, protect_prompt=False):
    """The transformers path's `CompressionConfig` (streaming, sink 16), the same object vLLM is given."""
    return vllm_compression(
        mask, sparsity, sink=SINK, window=window, window_prefill=window_prefill, protect_prompt=protect_prompt
    )


@pytest.mark.parametrize(
    "sparsity, window_prefill, protect_prompt",
    [(0.5, False, False), (0.75, False, False), (0.5, True, False), (0.5, False, True), (0.75, False, True)],
    ids=["s0.5", "s0.75", "s0.5-windowed", "s0.5-protected", "s0.75-protected"],
)
def test_tokens_equal_the_transformers_path_in_the_same_form(demo, sparsity, window_prefill, protect_prompt):
    model, tokenizer, problems, prompts, mask = demo
    config = _form(mask, sparsity, window_prefill, protect_prompt=protect_prompt)
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        managers, _ = kv_groups(llm)
        # the eval and protected forms run as rings on vLLM's CPU kernel; the windowed prompt as rlkv's gather form
        ring = not window_prefill
        assert ("RingManager" if ring else "SinkWindowManager") in {type(m).__name__ for m in managers}
        served = greedy(llm, prompts)
    reference = generate(
        model, tokenizer, prompts, 200, compression=config, apply_chat_template=False, progress=False
    )
    equal = sum(a == o.token_ids for a, o in zip(served, reference))
    assert equal >= 46, f"{equal} of 48 generations equal"
    ours, theirs = solved(tokenizer, problems, served, reference)
    assert abs(ours - theirs) <= 1, (ours, theirs)
    assert len(tokenizer(prompts[0]).input_ids) > SINK + WINDOW + 1  # the prompt is longer than what is kept
    if protect_prompt:  # the protected form is another computation: its tokens are not the evictable form's
        evictable = generate(
            model,
            tokenizer,
            prompts,
            200,
            compression=_form(mask, sparsity),
            apply_chat_template=False,
            progress=False,
        )
        assert sum(a != o.token_ids for a, o in zip(served, evictable)) >= 4


def test_a_window_over_every_position_gives_stock_vllm_tokens(demo):
    model, _, _, prompts, mask = demo
    with engine() as llm:
        stock = greedy(llm, prompts[:16])
    config = _form(mask, 0.5, window=1024)
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        assert greedy(llm, prompts[:16]) == stock


def _torch_kernel(overrides: dict) -> dict:
    """The same split run by rlkv's gather form (the torch reference) instead of the platform's kernel."""
    return overrides | {CONFIG_KEY: overrides[CONFIG_KEY] | {"kernel": "torch"}}


@pytest.mark.parametrize(
    "sparsity, protect_prompt",
    [(0.5, False), (0.75, False), (0.5, True), (0.75, True)],
    ids=["s0.5", "s0.75", "s0.5-protected", "s0.75-protected"],
)
def test_the_ring_on_the_stock_kernel_gives_the_torch_references_tokens(demo, sparsity, protect_prompt):
    """The eval and protected forms on vLLM's CPU attention kernel (the rings) against rlkv's exact torch form,
    48 problems."""
    model, _, _, prompts, mask = demo
    overrides = compression_overrides(model.config, _form(mask, sparsity, protect_prompt=protect_prompt))
    with engine(hf_overrides=overrides) as llm:
        assert "RingManager" in {type(m).__name__ for m in kv_groups(llm)[0]}
        ring = greedy(llm, prompts)
    with engine(hf_overrides=_torch_kernel(overrides)) as llm:
        assert "RingManager" not in {type(m).__name__ for m in kv_groups(llm)[0]}
        reference = greedy(llm, prompts)
    equal = sum(a == b for a, b in zip(ring, reference))
    assert equal >= 46, f"{equal} of 48 generations equal"


@pytest.mark.parametrize("form", ["eval-form", "protected", "eval-form-torch", "protected-torch"])
def test_the_group_holds_sink_and_window_blocks_and_the_prompt_goes_back_to_the_pool(demo, form):
    model, _, _, _, mask = demo
    protect_prompt = form.startswith("protected")
    overrides = compression_overrides(model.config, _form(mask, 0.5, protect_prompt=protect_prompt))
    ring = not form.endswith("torch")
    if not ring:
        overrides = _torch_kernel(overrides)
    with engine(hf_overrides=overrides) as llm:
        kind = "RingManager" if ring else "SinkWindowManager"
        (full_group, sink_group), pool = groups_by_kind(llm, "FullAttentionManager", kind)
        free_before = pool.get_num_free_blocks()
        prompt_tokens = 300  # 10 blocks of 32
        held = blocks_per_step(llm, (full_group, sink_group), [5 + i % 50 for i in range(prompt_tokens)], 400)
        free_after = pool.get_num_free_blocks()
    assert len(held) >= 399
    full, kept, free = zip(*held)
    ring_blocks = -(-(SINK + WINDOW + 1) // BLOCK)  # 3: the ring's sink + window + 1 slots
    if ring and protect_prompt:  # the prompt, then its ring of window + 1 slots right after it
        assert kept[0] == -(-prompt_tokens // BLOCK)
        assert max(kept) == kept[-1] == -(-(prompt_tokens + WINDOW + 1) // BLOCK)  # 12
    elif ring:  # the ring and the prompt while it is read, then the ring alone, from the first generated step
        assert kept[0] == ring_blocks + -(-prompt_tokens // BLOCK)
        assert set(kept[1:]) == {ring_blocks}
    else:
        # sink blocks (the prompt's when protected) + window blocks (+1: a window not aligned to blocks)
        head = -(-(prompt_tokens if protect_prompt else SINK) // BLOCK)
        bound = head + -(-(WINDOW + 1) // BLOCK) + 1
        # the prompt is held whole while it is read (10 blocks), then only the kept blocks: freed at the next
        # step's scheduling, and constant from there on
        assert kept[0] == -(-prompt_tokens // BLOCK)
        assert max(kept[1:]) <= bound and min(kept[100:]) >= head + 2  # once the window is past the prompt
        assert protect_prompt or kept[0] > bound
    assert full[-1] == -(-(prompt_tokens + 399) // BLOCK)  # the full group holds every token
    # what the group freed went back to the shared pool: free blocks fell only by the full group's growth
    assert free[0] - free[-1] <= (full[-1] - full[0]) + (max(kept) - kept[0]) + 1
    assert free_after == free_before  # finishing returns every block


@pytest.mark.parametrize("kernel", ["stock", "torch"])
def test_chunked_prefill_and_prefix_caching_give_the_same_tokens(demo, kernel):
    model, _, _, prompts, mask = demo
    overrides = compression_overrides(model.config, _form(mask, 0.5))
    if kernel == "torch":
        overrides = _torch_kernel(overrides)
    with engine(hf_overrides=overrides, enable_prefix_caching=False) as llm:
        plain = greedy(llm, prompts[:8])
    # 64-token chunks: a 349-token prompt in 6 forwards, each reading the earlier chunks in full
    with engine(hf_overrides=overrides, enable_prefix_caching=False, max_num_batched_tokens=64) as llm:
        assert greedy(llm, prompts[:8]) == plain
    with engine(hf_overrides=overrides, enable_prefix_caching=True) as llm:
        # the torch form's second pass hits the prompt blocks; the ring caches none (`ring.py`)
        cached = greedy(llm, prompts[:8]) + greedy(llm, prompts[:8])
    assert cached == plain + plain


def test_four_kv_heads_non_contiguous_parts_equal_the_transformers_path(tmp_path, make_model):
    from vllm import SamplingParams

    from rlkv.testing import tiny_tokenizer

    model = make_model("llama", num_key_value_heads=4, num_attention_heads=8, head_dim=32, hidden_size=128)
    tokenizer = tiny_tokenizer()  # head_dim 32: vLLM's CPU kernel (the full heads) needs a multiple of 32
    model.save_pretrained(tmp_path / "tiny")
    mask = HeadMask.random(model, seed=3)
    config = _form(mask, 0.5)
    layers = [row.nonzero().flatten().tolist() for row in config.full_heads(model)]
    assert any(heads not in ([0, 1], [1, 2], [2, 3]) for heads in layers), layers  # some part is gathered
    prompts = [p["problem"] for p in load_chain_task("test", 12)]
    ids = [tokenizer(p).input_ids for p in prompts]
    assert min(map(len, ids)) > SINK + WINDOW + 1
    with engine(
        str(tmp_path / "tiny"),
        hf_overrides=compression_overrides(model.config, config),
        skip_tokenizer_init=True,
    ) as llm:
        params = SamplingParams(temperature=0, max_tokens=60, detokenize=False)
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        served = [list(o.outputs[0].token_ids) for o in outs]
    reference = generate(
        model, tokenizer, prompts, 60, compression=config, apply_chat_template=False, progress=False
    )
    equal = sum(a == o.token_ids for a, o in zip(served, reference))
    assert equal >= 11, f"{equal} of 12 equal"


def test_an_uneven_mask_is_grouped_without_padding_the_full_heads(demo):
    """s=0.375 on the demo model: 5 full and 3 compressed KV heads. In one spec bucket vLLM makes groups of 3
    and pads the full kind to 6 (67% of the ideal saving); the split's buckets (`groups.plan_groups`) give
    groups vLLM pads only in the compressed kind, as planned, and the transformers path's tokens."""
    from rlkv.inference.vllm import head_split
    from rlkv.vllm_plugin.groups import plan_groups

    model, tokenizer, _, prompts, mask = demo
    config = _form(mask, 0.375)
    split = head_split(model, config)
    full = sum(map(len, split.full_kv_heads))
    plan = plan_groups(full, 8 - full)
    assert (full, plan.saving_kept) == (5, 1.0) and len(plan.buckets) > 1
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config.kv_cache_groups  # read only
        size = max(len(g.layer_names) for g in groups)
        full_groups = [
            len(g.layer_names) for g in groups if type(g.kv_cache_spec).__name__ == "FullAttentionSpec"
        ]
        assert sum(full_groups) == full and all(n == size for n in full_groups)  # no padding in the full kind
        assert (size, len(groups)) == (plan.group_size, plan.groups)
        served = greedy(llm, prompts[:16])
    reference = generate(
        model, tokenizer, prompts[:16], 200, compression=config, apply_chat_template=False, progress=False
    )
    equal = sum(a == o.token_ids for a, o in zip(served, reference))
    assert equal >= 15, f"{equal} of 16 generations equal"
