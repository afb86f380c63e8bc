"""Helpers of the vLLM tier: an engine per block, greedy tokens, the KV cache manager's groups."""

import contextlib
import gc

import vllm

DEMO = "assets/demo-model"
REAL = "models/qwen2.5-coder-0.5b-instruct"


@contextlib.contextmanager
def engine(model: str = DEMO, **kwargs):
    """A `vllm.LLM` for the duration of the block (fp32, eager, 32-token blocks, seed 0)."""
    settings = {"dtype": "float32", "enforce_eager": True, "block_size": 32, "seed": 0, "max_model_len": 1024}
    llm = vllm.LLM(model=model, **(settings | kwargs))
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def greedy(llm, prompts, max_tokens=200, **kwargs):
    """Greedy token ids per prompt."""
    params = vllm.SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def kv_groups(llm):
    """vLLM's KV cache manager in this process: (its per-group managers, the block pool).

    Private engine state, read only by these tests: `LLMEngine.engine_core` is the in-process client.
    """
    manager = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager
    return manager.coordinator.single_type_managers, manager.block_pool


def groups_by_kind(llm, *kinds: str):
    """([the group manager of each of `kinds` (class names, e.g. "FullAttentionManager")], the block pool);
    fails unless the engine has exactly one group of each kind named."""
    managers, pool = kv_groups(llm)
    names = [type(m).__name__ for m in managers]
    assert all(names.count(k) == 1 for k in kinds), names
    return [managers[names.index(k)] for k in kinds], pool


def blocks_per_step(llm, groups, prompt_ids, max_tokens):
    """Run one request (EOS ignored) step by step; per step after its first scheduling: the blocks it holds
    in each of `groups` (managers of `kv_groups`, null blocks not counted) and the pool's free blocks."""
    from vllm import SamplingParams

    _, pool = kv_groups(llm)
    core = llm.llm_engine
    core.add_request(
        "r",
        {"prompt_token_ids": prompt_ids},
        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )
    held = []
    while core.has_unfinished_requests():
        core.step()
        blocks = [[b for b in next(iter(m.req_to_blocks.values()), []) if not b.is_null] for m in groups]
        if blocks[0]:
            held.append((*map(len, blocks), pool.get_num_free_blocks()))
    return held


def solved(tokenizer, problems, served, reference) -> tuple[int, int]:
    """Chain problems solved by vLLM's token ids `served` and by the transformers outputs `reference`."""
    from rlkv.data.chain_task import verify_chain

    ours = sum(
        verify_chain(tokenizer.decode(t, skip_special_tokens=True), p["answer"])
        for t, p in zip(served, problems)
    )
    return ours, sum(verify_chain(o.text, p["answer"]) for o, p in zip(reference, problems))


def demo_chain(num: int = 48):
    """The demo model (fp32), its tokenizer, `num` held-out chain problems, their prompts, a seeded random mask."""
    from rlkv import HeadMask
    from rlkv.data.chain_task import load_chain_task
    from rlkv.data.prompts import build_prompt
    from rlkv.inference import load

    model, tokenizer = load(DEMO, dtype="float32")
    problems = load_chain_task("test", num)
    prompts = [build_prompt(p, tokenizer) for p in problems]
    return model, tokenizer, problems, prompts, HeadMask.random(model, seed=0)


def model_runner(llm):
    """The model runner of `llm`'s engine (in-process engines only). Private engine state, read only by tests."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
