"""Token eviction on vLLM (`rlkv.vllm_plugin.eviction`): the compressed heads keep what a policy chooses, in a
fixed-capacity KV cache group whose freed blocks go back to vLLM's pool.

References: rlkv's transformers path with the same `CompressionConfig` (the eval's forms: `rlkv+rkv` =
the mask's full heads, R-KV on the others at budget 80 with sink 16 + window 8 and buffer 0; `rkv` = R-KV
on every head at a ratio budget), demo model, fp32, greedy.
"""

import logging
import re

import pytest

pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm_engines import DEMO, blocks_per_step, demo_chain, engine, greedy, kv_groups, model_runner, solved  # noqa: E402

from rlkv.eval.methods import method_config  # noqa: E402
from rlkv.inference import generate  # noqa: E402
from rlkv.inference.vllm import compression_overrides  # noqa: E402
from rlkv.vllm_plugin.fence import eviction_compactions, in_process_scheduler  # noqa: E402

BLOCK = 32


@pytest.fixture(scope="module")
def demo():
    return demo_chain()


def _method(model, mask, method, sparsity=0.5):
    """The eval's `CompressionConfig` of `method` (matched budgets: buffer 0, the prompt evictable)."""
    return method_config(method, sparsity, model=model, masks={"rlkv": mask})


def _scheduled(config, prompt_lengths, served) -> list[int]:
    """Compactions `RowSchedule` makes for each request of these prompt lengths and generated tokens."""
    from rlkv.cache.settings import CompressionSettings
    from rlkv.cache.static.budget import RowSchedule, static_form
    from rlkv.policies import get_policy

    policy = get_policy(config.policy, **config.policy_kwargs)
    settings = CompressionSettings(policy, config.sink, config.window, config.budget, config.protect_prompt)
    form = static_form(settings, True, 1024)
    counts = []
    for prompt, tokens in zip(prompt_lengths, served, strict=True):
        schedule = RowSchedule(form, [prompt])
        counts.append(sum(schedule.due(g) for g in range(len(tokens))))
    return counts


COMPACTIONS_LINE = re.compile(
    r"rlkv: request (\S+): (\d+) compactions of its evicting heads \(prompt (\d+) tokens"
)


class _Recorder(logging.Filter):
    """Records every message rlkv's plugin logs (a filter on its logger: vLLM's logging set-up at each engine
    start replaces the handlers of its child loggers, never their filters)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def filter(self, record):
        self.lines.append(record.getMessage())
        return True


@pytest.fixture
def plugin_log(monkeypatch):
    """The messages of the `vllm.rlkv` logger while the test runs."""
    from vllm import envs

    # TRL's import (other tests of this process) sets VLLM_LOGGING_LEVEL=ERROR, and each engine start applies
    # it to vLLM's logger, the plugin's parent, resetting the plugin's own level: this test's engines log at
    # INFO (vLLM caches its environment once an engine has started: the cache is dropped on both sides)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "INFO")
    envs.disable_envs_cache()
    recorder, logger = _Recorder(), logging.getLogger("vllm.rlkv")
    # another library's logging set-up earlier in the session (dictConfig's disable_existing_loggers) may have
    # disabled this logger or raised its level: the test reads what the plugin says, so it turns both back
    disabled, level = logger.disabled, logger.level
    logger.disabled = False
    logger.setLevel(logging.INFO)
    logger.addFilter(recorder)
    yield recorder.lines
    logger.removeFilter(recorder)
    logger.disabled, logger.level = disabled, level
    envs.disable_envs_cache()  # the next engine reads the environment monkeypatch restores


def _served_and_reference(model, tokenizer, prompts, config, plugin_log, max_tokens=200):
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        managers, _ = kv_groups(llm)
        assert "EvictionManager" in {type(m).__name__ for m in managers}
        served = greedy(llm, prompts, max_tokens)
        compactions = eviction_compactions(llm)
    # in each eviction group, the compactions rlkv's schedule makes: the prompt's (longer than the budget), then
    # each generated step's that is due (buffer 0: every step at an int budget, about every other one at a
    # ratio of 0.5, whose budget grows by one every other token); the first token is sampled by the prompt's forward
    prompt_lengths = [len(tokenizer(p).input_ids) for p in prompts]
    scheduled = _scheduled(config, prompt_lengths, served)
    assert compactions and set(compactions) == {sum(scheduled)}, compactions
    # and each request's count is in vLLM's log, once (one line per request, whatever the number of groups)
    logged = [m.groups() for line in plugin_log if (m := COMPACTIONS_LINE.match(line))]
    assert sorted((int(p), int(n)) for _, n, p in logged) == sorted(zip(prompt_lengths, scheduled))
    reference = generate(
        model, tokenizer, prompts, max_tokens, compression=config, apply_chat_template=False, progress=False
    )
    return served, reference


@pytest.mark.parametrize("method", ["rlkv+rkv", "rkv", "rlkv+h2o", "h2o"])
def test_tokens_equal_the_transformers_path(demo, method, plugin_log):
    """R-KV at buffer 0 (a compaction every step once over budget) and H2O (one eviction per step over budget,
    scored by the attention each slot received: an explicit fp32 softmax on both engines)."""
    model, tokenizer, problems, prompts, mask = demo
    config = _method(model, mask, method)
    assert config.protect_prompt is False and config.policy_kwargs.get("buffer", 0) == 0
    served, reference = _served_and_reference(model, tokenizer, prompts, config, plugin_log)
    equal = sum(a == o.token_ids for a, o in zip(served, reference))
    assert equal >= 44, f"{equal} of 48 generations equal"
    ours, theirs = solved(tokenizer, problems, served, reference)
    assert abs(ours - theirs) <= 2, (ours, theirs)


@pytest.mark.parametrize("method", ["rlkv+rkv", "rlkv+h2o"])
def test_a_protected_prompt_gives_the_transformers_paths_tokens(demo, method):
    """`protect_prompt`: every prompt token stays (each request alone in a compaction; H2O does not score the
    prompt by its own attention), only generated tokens are evicted: a budget of 8 (sink 2 + window 2) so that
    the demo's 14-20 generated tokens are compacted."""
    import dataclasses

    from rlkv.eval.methods import BudgetRule, method_config

    model, tokenizer, _, prompts, mask = demo
    config = method_config(
        method, 0.5, model=model, masks={"rlkv": mask}, rule=BudgetRule(protect_prompt=True)
    )
    config = dataclasses.replace(config, budget=8, sink=2, window=2)
    assert config.protect_prompt
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        served = greedy(llm, prompts[:16], 200)
        assert min(eviction_compactions(llm)) >= 16  # every request compacted
    reference = generate(
        model, tokenizer, prompts[:16], 200, compression=config, apply_chat_template=False, progress=False
    )
    equal = sum(a == o.token_ids for a, o in zip(served, reference))
    assert equal >= 15, f"{equal} of 16 generations equal"


def test_blocks_per_request_stay_within_the_capacity(demo, plugin_log):
    from rlkv.vllm_plugin.models import PREFIX_CACHING_WARNING

    model, tokenizer, _, prompts, mask = demo
    config = _method(model, mask, "rlkv+rkv")  # budget 80 + 1 slot for the newest token
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        # vLLM's default turns prefix caching on: the engine says it can never hit with eviction
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
        assert plugin_log.count(PREFIX_CACHING_WARNING) == 1
        managers, pool = kv_groups(llm)
        groups = [m for m in managers if type(m).__name__ == "EvictionManager"][:1]
        free = pool.get_num_free_blocks()
        prompt_ids = tokenizer(prompts[0]).input_ids  # a prompt of several blocks
        held = blocks_per_step(llm, groups, prompt_ids, max_tokens=401)
        assert pool.get_num_free_blocks() == free  # every block back once it finished
    prompt_blocks = -(-len(prompt_ids) // BLOCK)
    assert prompt_blocks > 4 and held[0][0] == prompt_blocks  # the prompt's step holds every block
    assert max(h[0] for h in held[2:]) <= -(-81 // BLOCK) + 1  # then at most ceil(capacity / block) + 1
    assert len(held) >= 400  # decode steps


def test_a_split_over_several_eviction_groups_logs_each_request_once(demo, plugin_log):
    """s=0.375 on the demo model: 3 compressed KV heads laid out over several spec buckets, so several eviction
    groups run the same schedule; each request's compactions are logged once, equal to the schedule's."""
    model, tokenizer, _, prompts, mask = demo
    config = _method(model, mask, "rlkv+rkv", sparsity=0.375)
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        managers, _ = kv_groups(llm)
        assert sum(type(m).__name__ == "EvictionManager" for m in managers) > 1
        served = greedy(llm, prompts[:6], 120)
        compactions = eviction_compactions(llm)
    lengths = [len(tokenizer(p).input_ids) for p in prompts[:6]]
    scheduled = _scheduled(config, lengths, served)
    assert len(compactions) > 1 and set(compactions) == {sum(scheduled)}
    logged = [m.groups() for line in plugin_log if (m := COMPACTIONS_LINE.match(line))]
    assert sorted((int(p), int(n)) for _, n, p in logged) == sorted(zip(lengths, scheduled))


def test_rlkvs_own_engines_start_an_eviction_split_without_prefix_caching(demo, plugin_log):
    from rlkv.inference.vllm_engine import VLLMRunner
    from rlkv.vllm_plugin.models import PREFIX_CACHING_WARNING

    model, _, _, _, mask = demo
    overrides = compression_overrides(model.config, _method(model, mask, "rkv"))
    runner = VLLMRunner(DEMO, dtype="float32", enforce_eager=True, block_size=32, max_model_len=512)
    try:
        llm = runner.engine(overrides)
        assert llm.llm_engine.vllm_config.cache_config.enable_prefix_caching is False
        assert PREFIX_CACHING_WARNING not in plugin_log
    finally:
        runner.close()


def test_abort_and_preemption_return_every_block_and_resumed_requests_finish(demo):
    from vllm import SamplingParams

    model, tokenizer, _, prompts, mask = demo
    config = _method(model, mask, "rlkv+rkv")
    # 48 blocks of 32 tokens over both groups: four requests of a 349-token prompt + 300 new tokens need about
    # 4 x (21 + 3) at the end, so vLLM preempts (recompute) and resumes them
    overrides = compression_overrides(model.config, config)
    with engine(hf_overrides=overrides, num_gpu_blocks_override=48, max_model_len=700) as llm:
        _, pool = kv_groups(llm)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        free = pool.get_num_free_blocks()
        ids = tokenizer(prompts[0]).input_ids
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        core = llm.llm_engine
        for i in range(5):
            core.add_request(f"r{i}", {"prompt_token_ids": ids}, params)
        finished, preempted, step = {}, 0, 0
        while core.has_unfinished_requests():
            for out in core.step():
                if out.finished:
                    finished[out.request_id] = list(out.outputs[0].token_ids)
            step += 1
            if step == 30:
                core.abort_request(["r4"])
            preempted = max([preempted, *(r.num_preemptions for r in scheduler.requests.values())])
        assert pool.get_num_free_blocks() == free  # every block of the aborted, preempted and finished ones
        assert preempted >= 1
        assert sorted(finished) == ["r0", "r1", "r2", "r3"] and all(len(t) == 300 for t in finished.values())


@pytest.mark.parametrize("method", ["rlkv+rkv", "rkv", "rlkv+h2o"])
def test_one_compaction_keeps_the_transformers_paths_tokens_in_every_head(demo, method):
    """The policy's decisions, not just the tokens: after the prompt's compaction and one generated step's, each
    compressed (layer, KV head) keeps the same positions on vLLM as in rlkv's transformers cache (fp32; R-KV's
    scores from keys and queries computed by two engines agree to ~1e-5, so only exact ties could differ)."""
    import torch

    from rlkv.inference import make_cache

    model, tokenizer, _, prompts, mask = demo
    config = _method(model, mask, method)
    ids = tokenizer(prompts[0], return_tensors="pt").input_ids
    cache = make_cache(model, config)
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1)
        model(input_ids=first[:, None], past_key_values=cache, use_cache=True)
    reference = {
        layer.layer_idx: [sorted(p for p in row if p >= 0) for row in layer.store.positions[0].tolist()]
        for layer in cache.layers
        if layer.store is not None
    }
    with engine(hf_overrides=compression_overrides(model.config, config)) as llm:
        served = greedy(llm, [ids[0].tolist()], max_tokens=2)
        kept = _kept_positions(llm)
    assert served[0][0] == first.item()
    assert set(kept) == set(reference) and len(reference) >= 3
    for layer, heads in reference.items():
        assert kept[layer] == heads, f"layer {layer}"


def _kept_positions(llm) -> dict[int, list[list[int]]]:
    """Per model layer, each compressed KV head's kept positions (sorted) of the engine's one request, read
    from the eviction layers' position tables (private runner state, tests only)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    builder = next(
        b
        for groups in runner.attn_groups
        for group in groups
        for b in group.metadata_builders
        if any(
            c.__name__ == "EvictionMetadataBuilder" for c in type(b).__mro__
        )  # the torch or the stock form's
    )
    (state,) = builder.requests.values()
    kept: dict[int, list[list[int]]] = {}
    for module in runner.model.modules():
        if type(module).__name__ != "EvictionAttention":
            continue
        positions = module.impl.tables[0][state.row]  # [H_kv, capacity], -1 = empty
        heads = [sorted(p for p in row.tolist() if p >= 0) for row in positions]
        order = module.rlkv_head_ids.tolist()
        layer = kept.setdefault(module.rlkv_layer_index, {})
        layer.update(dict(zip(order, heads)))
    return {layer: [heads[h] for h in sorted(heads)] for layer, heads in kept.items()}


@pytest.mark.parametrize("method", ["rlkv+rkv", "rlkv+h2o"])
def test_chunked_prefill_gives_the_same_tokens(demo, method):
    """A prompt read in 64-token chunks (each chunk attends every earlier prompt slot; H2O adds up each chunk's
    attention over slots beyond the budget's capacity) is compacted as a whole one."""
    model, tokenizer, _, prompts, mask = demo
    config = _method(model, mask, method)
    overrides = compression_overrides(model.config, config)
    with engine(hf_overrides=overrides) as llm:
        whole = greedy(llm, prompts[:16])
    with engine(hf_overrides=overrides, enable_chunked_prefill=True, max_num_batched_tokens=64) as llm:
        chunked = greedy(llm, prompts[:16])
    assert sum(a == b for a, b in zip(whole, chunked)) >= 15


def test_the_eviction_tables_are_made_at_start_and_small_next_to_the_kv_pool(demo):
    """The group's per-request tables (slot positions, observation queries) are made in vLLM's profiling run,
    before the KV pool is sized (on a GPU vLLM then sizes the pool from what is left), bounded by 2 x
    max_num_seqs rows x the group's capacity; at max_num_seqs 64 they are under 1% of the pool. vLLM's CPU
    worker runs the profiling run only to warm up its compiled path (not under enforce_eager)."""
    model, _, _, prompts, mask = demo
    config = _method(model, mask, "rlkv+rkv")
    overrides = compression_overrides(model.config, config)
    with engine(hf_overrides=overrides, max_num_seqs=64, enforce_eager=False) as llm:
        layers = [m for m in model_runner(llm).model.modules() if type(m).__name__ == "EvictionAttention"]
        made = [layer.impl.tables for layer in layers]
        kv_bytes = sum(t.size for t in in_process_scheduler(llm).kv_cache_config.kv_cache_tensors)
        greedy(llm, prompts[:4], 20)  # the tables serve the requests as made
        assert all(layer.impl.tables is tables for layer, tables in zip(layers, made))
    assert layers and all(tables is not None for tables in made)
    table_bytes = sum(t.numel() * t.element_size() for tables in made for t in tables if t is not None)
    assert all(tables[0].shape[0] == 128 for tables in made)  # 2 x max_num_seqs rows
    assert 0 < table_bytes < 0.01 * kv_bytes, (table_bytes, kv_bytes)
