"""Compressed GRPO rollouts on the static-shape cache (`RolloutGenerator(static_cache=True)`): the same
completions, log-probs and KV counts as the dynamic cache, no host read per decode step, one
compiled decode graph over successive rollouts, and a trainer option that selects it."""

import tempfile
from pathlib import Path

import pytest
import torch
from test_rollout_compressed import compressed_trainer, logged
from transformers import GenerationConfig

from rlkv import HeadMask
from rlkv.cache import StaticHeadMixedCache
from rlkv.inference.row_ends import ROW_END_READ_EVERY
from rlkv.rollout import CompressedRolloutConfig
from rlkv.rollout.generation import RolloutGenerator
from rlkv.testing import HostSyncCounter, graph_counting_compile, tiny_model

LAYOUTS = {
    "streaming": dict(policy="streaming", sink=2, window=4),
    "rkv": dict(policy="rkv", sink=2, window=4, budget=10, policy_kwargs=dict(buffer=4)),
}


def _config(tokens: int, **extra) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, pad_token_id=0, eos_token_id=1, **extra
    )


def _compression(model, layout: str) -> CompressedRolloutConfig:
    return CompressedRolloutConfig(head_mask=HeadMask.random(model, seed=1), sparsity=0.5, **LAYOUTS[layout])


def _sample(generator, model, batch, config, seed=0):
    torch.manual_seed(seed)
    return generator(model, *batch, config, temperature=0.8, eos_token_ids=[1])


@pytest.mark.cross_path_floats
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_static_rollouts_equal_dynamic_rollouts(layout, left_padded_batch):
    """Tokens, recorded log-probs (1e-5) and kept / evicted counts equal the dynamic cache's."""
    model = tiny_model("llama")
    compression = _compression(model, layout)
    config = _config(24)
    dynamic = _sample(RolloutGenerator(compression, static_cache=False), model, left_padded_batch, config)
    static = _sample(RolloutGenerator(compression, static_cache=True), model, left_padded_batch, config)
    assert static.completion_ids == dynamic.completion_ids
    for got, want in zip(static.logprobs, dynamic.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    assert (static.kv.kept_tokens, static.kv.evictions) == (dynamic.kv.kept_tokens, dynamic.kv.evictions)
    assert static.kv.evictions > 0
    assert static.kv.logical_length == dynamic.kv.logical_length
    assert static.kv.full_resident_bytes == dynamic.kv.full_resident_bytes


@pytest.mark.cross_path_floats
def test_static_rollout_cache_is_reused_and_reports_its_capacity(left_padded_batch):
    """A second rollout that fits reuses the cache's tensors (same addresses) and samples what a fresh
    generator samples; resident bytes are the tensors' storage (the allocated capacity), also the peak."""
    model = tiny_model("llama")
    compression = _compression(model, "streaming")
    generator = RolloutGenerator(compression, static_cache=True)
    _sample(generator, model, left_padded_batch, _config(24), seed=5)
    cache = generator.kept_static_cache
    addresses = [t.data_ptr() for layer in cache.layers for t in layer.buffers.values()]
    again = _sample(generator, model, left_padded_batch, _config(16), seed=6)
    assert generator.kept_static_cache is cache
    assert [t.data_ptr() for layer in cache.layers for t in layer.buffers.values()] == addresses
    fresh = _sample(
        RolloutGenerator(compression, static_cache=True), model, left_padded_batch, _config(16), seed=6
    )
    assert again.completion_ids == fresh.completion_ids
    # the reused cache attends over the 24-token rollout's capacity, the fresh one over 16 tokens':
    # another reduction order, so log-probs agree to 1e-5, not bitwise (AVX-512 differs at 1e-7)
    for got, want in zip(again.logprobs, fresh.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    assert again.kv.resident_bytes == again.kv.peak_bytes == cache.resident_bytes()
    held = sum(t.untyped_storage().nbytes() for layer in cache.layers for t in layer.buffers.values())
    assert cache.resident_bytes() >= held  # every buffer counted (plus head indices)
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is back


def test_static_rollouts_read_finished_rows_every_few_steps(make_model, left_padded_batch):
    model = make_model("llama")
    generator = RolloutGenerator(_compression(model, "rkv"), static_cache=True)
    _sample(generator, model, left_padded_batch, _config(8))  # allocation outside the count
    syncs = {}
    for tokens in (16, 32):
        with HostSyncCounter() as counter:
            batch = _sample(generator, model, left_padded_batch, _config(tokens))
        assert [len(ids) for ids in batch.completion_ids] == [tokens] * 4
        syncs[tokens] = counter.count
    assert syncs[32] - syncs[16] == 16 // ROW_END_READ_EVERY == 1, syncs


def test_compiled_static_rollouts_capture_one_graph(left_padded_batch):
    """Two 64-token rollouts decode without a recompile (`fullgraph=True, dynamic=False`) and sample
    what eager decoding samples: two graphs, the model's step and the log-prob recorder (dynamo
    compiles a forward hook as its own frame), both of static shapes and without a host value."""
    model = tiny_model("llama")
    compression = _compression(model, "rkv")
    compile_config, graphs = graph_counting_compile()
    compiled = RolloutGenerator(compression, static_cache=True, compile_config=compile_config)
    eager = RolloutGenerator(compression, static_cache=True)
    torch.compiler.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seed in (0, 1):
            got = _sample(compiled, model, left_padded_batch, _config(64), seed=seed)
            want = _sample(eager, model, left_padded_batch, _config(64), seed=seed)
            assert got.completion_ids == want.completion_ids
            assert (
                got.logprobs == want.logprobs
            )  # bitwise: the recording backend runs the same kernels eagerly
    assert len(graphs) == 2


def test_trainer_with_static_rollouts_trains_like_the_dynamic_cache(tmp_path, make_model, tokenizer):
    """`CompressedRolloutConfig(static_cache=True)`: the trainer's rollouts run on one kept static cache
    and two GRPO steps log the dynamic cache's losses, lengths, evictions and importance ratios;
    a bad value names the field."""
    with pytest.raises(ValueError, match="static_cache='yes'"):
        CompressedRolloutConfig(static_cache="yes")
    runs = {}
    for static in (False, True):
        model = make_model("llama")
        compression = CompressedRolloutConfig(
            head_mask=HeadMask.random(model, seed=1), sparsity=0.5, sink=2, window=4, static_cache=static
        )
        trainer = compressed_trainer(tmp_path, model, tokenizer, compression)
        trainer.train()
        runs[static] = trainer
        assert isinstance(trainer.rollout_generator.kept_static_cache, StaticHeadMixedCache) == static
    for key in ("completions/mean_length", "rollout_kv/evictions", "rollout_kv/kept_tokens"):
        assert logged(runs[True], key) == logged(runs[False], key), key
    assert logged(runs[True], "rollout_kv/evictions")[0] > 0
    for key in ("loss", "sampling/importance_sampling_ratio/mean"):
        assert logged(runs[True], key) == pytest.approx(logged(runs[False], key), abs=1e-5), key


def test_inductor_compiles_static_rollouts(left_padded_batch, monkeypatch):
    """torch's real compiler (inductor, C++ on CPU; Triton and CUDA graphs on a GPU) lowers the rollout
    step and the log-prob hook: the same tokens as eager decoding, log-probs within 1e-5, no recompile."""
    # inductor's code cache is not keyed on ATen's CPU capability: kernels cached under AVX-512 fail to
    # build in a run under ATEN_CPU_CAPABILITY=default ("at::vec has not been declared"), so one cache each
    capability = torch.backends.cpu.get_cpu_capability().lower()
    monkeypatch.setenv(
        "TORCHINDUCTOR_CACHE_DIR", str(Path(tempfile.gettempdir()) / f"rlkv-inductor-{capability}")
    )
    model = tiny_model("llama")
    compression = _compression(model, "rkv")
    compile_config, _ = graph_counting_compile(backend="inductor")
    compiled = RolloutGenerator(compression, static_cache=True, compile_config=compile_config)
    eager = RolloutGenerator(compression, static_cache=True)
    torch.compiler.reset()
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            for seed in (0, 1):
                got = _sample(compiled, model, left_padded_batch, _config(16), seed=seed)
                want = _sample(eager, model, left_padded_batch, _config(16), seed=seed)
                assert got.completion_ids == want.completion_ids
                for a, b in zip(got.logprobs, want.logprobs, strict=True):
                    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-5)
    finally:
        torch.compiler.reset()
