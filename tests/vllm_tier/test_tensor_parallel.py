"""A head mask served with vLLM's tensor parallelism over two CPU ranks (issue 78).

Each rank holds half of every layer's KV heads; rlkv cuts the mask balanced (every layer's full heads a
multiple of the rank count), permutes each layer's heads at load so that every rank's share is its full heads
then its compressed ones, and every rank builds the same KV cache groups. References: the same balanced split
on one rank (TP 1), and stock vLLM at TP 2 for a split whose heads are all full. Demo model (2 KV heads per
layer: one per rank) and a tiny Llama with 4 KV heads (two per rank, parts of either kind), fp32, greedy.
vLLM's CPU workers need a core each, bound by VLLM_CPU_OMP_THREADS_BIND.
"""

import os

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO, blocks_per_step, demo_chain, engine, greedy, groups_by_kind  # noqa: E402

from rlkv.inference.vllm import model_config, vllm_overrides  # noqa: E402
from rlkv.vllm_plugin.split import HeadSplit  # noqa: E402

pytestmark = pytest.mark.skipif(
    (os.cpu_count() or 1) < 2, reason="tensor parallelism over two CPU ranks needs two cores (one per worker)"
)
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}


@pytest.fixture(autouse=True)
def one_core_per_rank(monkeypatch):
    # vLLM's CPU workers bind their threads to NUMA nodes; one node here, so each rank gets one core
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")


@pytest.mark.parametrize("sparsity", [0.5, 0.75])
def test_two_ranks_give_one_ranks_tokens_with_the_same_balanced_split(sparsity):
    _, tokenizer, problems, prompts, mask = demo_chain()
    overrides = vllm_overrides(DEMO, mask, sparsity, tensor_parallel_size=2)
    split = HeadSplit.from_config(model_config(DEMO).to_dict() | overrides)
    assert all(len(full) % 2 == 0 for full in split.full_kv_heads)
    assert any(full for full in split.full_kv_heads) and any(not full for full in split.full_kv_heads)
    equal = equal_on_one_and_two_ranks(overrides, prompts)
    assert equal >= 46, f"{equal} of 48 equal"


def equal_on_one_and_two_ranks(overrides: dict, prompts: list) -> int:
    """How many of `prompts` get the same greedy tokens from one rank and from two, with `overrides`."""
    with engine(DEMO, hf_overrides=overrides) as llm:
        one = greedy(llm, prompts)
    with engine(DEMO, hf_overrides=overrides, **TP2) as llm:
        two = greedy(llm, prompts)
    return sum(a == b for a, b in zip(one, two, strict=True))


def test_every_head_full_on_two_ranks_gives_stock_vllms_tokens():
    _, _, _, prompts, mask = demo_chain(16)
    with engine(DEMO, **TP2) as llm:
        stock = greedy(llm, prompts)
    with engine(DEMO, hf_overrides=vllm_overrides(DEMO, mask, 0.0, tensor_parallel_size=2), **TP2) as llm:
        served = greedy(llm, prompts)
    assert served == stock


def test_four_kv_heads_two_ranks_with_both_kinds_on_each_rank(tmp_path, make_model):
    from vllm import SamplingParams

    from rlkv import HeadMask
    from rlkv.data.chain_task import load_chain_task
    from rlkv.testing import tiny_tokenizer

    model = make_model("llama", num_key_value_heads=4, num_attention_heads=8, head_dim=32, hidden_size=128)
    model.save_pretrained(tmp_path / "tiny")
    tokenizer = tiny_tokenizer()
    overrides = vllm_overrides(model.config, HeadMask.random(model, seed=3), 0.5, tensor_parallel_size=2)
    split = HeadSplit.from_config(model.config.to_dict() | overrides)
    assert any(len(full) == 2 for full in split.full_kv_heads), (
        split.full_kv_heads
    )  # 1 full + 1 compressed a rank
    ids = [tokenizer(p["problem"]).input_ids for p in load_chain_task("test", 12)]
    params = SamplingParams(temperature=0, max_tokens=60, detokenize=False)
    runs = []
    for extra in ({}, TP2):
        with engine(str(tmp_path / "tiny"), hf_overrides=overrides, skip_tokenizer_init=True, **extra) as llm:
            outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
    equal = sum(a == b for a, b in zip(*runs, strict=True))
    assert equal >= 11, f"{equal} of 12 equal"


def test_on_two_ranks_the_compressed_groups_blocks_stay_constant_during_decode():
    """vLLM's one block pool serves both ranks (each holds its heads' share of every block): over 400 decode
    steps of a 300-token prompt the compressed group (the eval form's ring) holds its ring's blocks, as on one
    rank."""
    _, _, _, _, mask = demo_chain(1)
    with engine(DEMO, hf_overrides=vllm_overrides(DEMO, mask, 0.5, tensor_parallel_size=2), **TP2) as llm:
        (full_group, ring_group), pool = groups_by_kind(llm, "FullAttentionManager", "RingManager")
        free_before = pool.get_num_free_blocks()
        held = blocks_per_step(llm, (full_group, ring_group), [5 + i % 50 for i in range(300)], 400)
        free_after = pool.get_num_free_blocks()
    full, kept, _ = zip(*held)
    ring = -(-(16 + 64 + 1) // 32)  # the ring's sink + window + 1 slots
    assert kept[0] == ring + -(-300 // 32) and set(kept[1:]) == {ring}
    assert full[-1] == -(-(300 + len(held) - 1) // 32)  # the full group holds every token
    assert free_after == free_before


def test_r_kv_eviction_on_two_ranks_gives_one_ranks_tokens():
    """Eviction decides per head from that head's own scores, so each rank compacts its heads alone."""
    _, _, _, prompts, mask = demo_chain(16)
    overrides = vllm_overrides(
        DEMO, mask, 0.5, tensor_parallel_size=2, policy="rkv", budget=80, sink=16, window=8
    )
    equal = equal_on_one_and_two_ranks(overrides, prompts)
    assert equal >= 15, f"{equal} of 16 equal"
