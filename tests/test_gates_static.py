"""Gated attention (the trainer's mixed heads) on transformers' StaticCache (issue 40): the dynamic
cache's tokens and logits on left-padded rows, and a compiled decode step with static shapes that
never recompiles."""

import pytest
import torch
from transformers import StaticCache

from rlkv.gates import attach_gates
from rlkv.testing import graph_counting_compile, tiny_model
from tests.test_static_cache import greedy_generate

SINK, LOCAL = 2, 4
STEPS = 24
GATES = {
    # layer 0 mixed (one head all sink + local), layer 1 stock attention (every gate 1)
    "mixed-and-stock": [[0.0, 0.6], [1.0, 1.0]],
    "all-mixed": [[0.2, 0.7], [0.0, 0.5]],
}


def gated_model(gates: list[list[float]]):
    model = tiny_model("llama")
    attached = attach_gates(model, sink=SINK, local=LOCAL)
    with torch.no_grad():
        attached.alpha.copy_(torch.tensor(gates))
    return model


def _run(model, batch, steps=STEPS, cache=None, **kwargs):
    return greedy_generate(model, batch, cache, steps=steps, **kwargs)


def _static_cache(model, batch, steps):
    return StaticCache(config=model.config, max_cache_len=batch[0].shape[1] + steps)


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("gates", list(GATES))
def test_static_cache_gives_the_dynamic_caches_tokens_and_logits(left_padded_batch, gates):
    """The local branch finds each query's column from the mask: with a static cache the keys run past
    the queries to the cache's end, so "the queries are the last columns" no longer holds."""
    model = gated_model(GATES[gates])
    expected = _run(model, left_padded_batch)
    got = _run(model, left_padded_batch, cache=_static_cache(model, left_padded_batch, STEPS))
    assert torch.equal(got.sequences, expected.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(expected.logits), rtol=0, atol=1e-4)
    # the sink + local branch matters here: all-full gates give other tokens
    stock = _run(gated_model([[1.0, 1.0], [1.0, 1.0]]), left_padded_batch)
    assert not torch.equal(stock.sequences, expected.sequences)


@pytest.mark.parametrize("gates", list(GATES))
def test_compiled_gated_decode_runs_64_steps_without_recompiling(left_padded_batch, gates):
    """transformers' compiled decode (fullgraph, static shapes) over the gated attention captures one
    graph and replays it for 2 x 64 steps: the graph a CUDA graph can hold."""
    model = gated_model(GATES[gates])
    cache = _static_cache(model, left_padded_batch, 64)
    eager = _run(model, left_padded_batch, steps=64, cache=cache, disable_compile=True).sequences
    compile_config, graphs = graph_counting_compile()
    torch.compiler.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for _ in range(2):  # the second request replays the same graph
                cache.reset()
                compiled = _run(
                    model, left_padded_batch, steps=64, cache=cache, compile_config=compile_config
                )
                assert torch.equal(compiled.sequences, eager)
        assert len(graphs) == 1
    finally:
        torch.compiler.reset()


def test_compiled_gated_decode_follows_gate_changes(left_padded_batch):
    """A training step changes the gates between rollouts: the compiled decode reads new values of
    mixed gates from the parameter (no recompile), and a layer that becomes stock is a new graph."""
    model = gated_model(GATES["all-mixed"])
    gates = model.rlkv_gates
    cache = _static_cache(model, left_padded_batch, 16)
    compile_config, _ = graph_counting_compile(backend="eager")
    torch.compiler.reset()
    seen = []
    try:
        for alpha in ([[0.2, 0.7], [0.0, 0.5]], [[0.9, 0.1], [0.3, 0.0]], [[0.9, 0.1], [1.0, 1.0]]):
            with torch.no_grad():
                gates.alpha.copy_(torch.tensor(alpha))  # in place, as the optimizer does
            cache.reset()
            eager = _run(model, left_padded_batch, steps=16, cache=cache, disable_compile=True).sequences
            cache.reset()
            compiled = _run(model, left_padded_batch, steps=16, cache=cache, compile_config=compile_config)
            assert torch.equal(compiled.sequences, eager), alpha
            seen.append(eager)
        assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])  # the gates matter
    finally:
        torch.compiler.reset()


def test_gate_trainer_rollouts_decode_on_a_static_cache(tmp_path, tokenizer):
    """`GateGRPOConfig(cache_implementation="static")` (TRL's own field) samples the gated rollouts on
    transformers' StaticCache, the shape a CUDA graph holds, with the dynamic cache's completions."""
    from rlkv.trainers import GateGRPOTrainer
    from tests.test_trainer import config, prompts_dataset

    sampled, caches = {}, {}
    for implementation in ("dynamic", "static"):
        rows = []

        def reward(prompts, completions, completion_ids, rows=rows, **kwargs):
            rows.extend(completion_ids)
            return [0.5] * len(completion_ids)

        model = tiny_model("llama")
        trainer = GateGRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config(
                tmp_path / implementation,
                max_steps=1,
                gate_init=0.5,
                cache_implementation=None if implementation == "dynamic" else implementation,
            ),
            train_dataset=prompts_dataset(),
            processing_class=tokenizer,
        )
        seen = set()

        def hook(module, args, kwargs, seen=seen):
            cache = kwargs.get("cache", kwargs.get("past_key_values"))
            if cache is not None:
                seen.add(type(cache).__name__)

        model.register_forward_pre_hook(hook, with_kwargs=True)
        trainer.train()
        sampled[implementation], caches[implementation] = rows, seen
    assert caches == {"dynamic": {"DynamicCache"}, "static": {"StaticCache"}}
    assert sampled["static"] == sampled["dynamic"] and len(sampled["static"]) == 4
