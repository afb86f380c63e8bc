"""Helpers of the vLLM tier: an engine per block, greedy tokens, the KV cache manager's groups."""

import contextlib
import gc

import vllm

DEMO = "data/demo-model"
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
