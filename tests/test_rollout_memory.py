"""Rollout KV memory report (rlkv.rollout.memory): compressed vs full, every number from real runs."""

import json
from dataclasses import astuple

import pytest

from rlkv.head_mask import HeadMask
from rlkv.rollout import CompressedRolloutConfig
from rlkv.rollout.memory import measure_rollout_memory

# the longest prompt first: every batch (prompts are cycled) is padded to its length
PROMPTS = ["solve the following math problem", "let x be 3 then x + 4", "wait"]


def test_memory_report_max_batch_and_peaks_are_measured(tmp_path, make_model, tokenizer):
    model = make_model("llama")
    compression = CompressedRolloutConfig(head_mask=HeadMask.random(model), sparsity=0.75, sink=2, window=8)
    new_tokens = 96
    prompt_len = max(
        len(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for p in PROMPTS
    )
    # a full cache holds K and V of every layer (2) and KV head (2) for prompt + generated tokens
    # (the last sampled token is never fed back), 16 fp32 dims: the cap fits exactly 3 such rollouts
    full_per_sequence = 2 * 2 * 2 * (prompt_len + new_tokens - 1) * 16 * 4
    cap = 3 * full_per_sequence

    report = measure_rollout_memory(
        model, tokenizer, PROMPTS, compression, max_new_tokens=new_tokens, kv_cap_bytes=cap, batch_size=2
    )
    assert report.full.peak_bytes == 2 * full_per_sequence
    for m in (report.full, report.compressed):
        b = m.max_batch
        assert m.probes[b] <= cap < m.probes[b + 1]  # b fits, b + 1 was run and does not
    assert report.full.max_batch == 3
    assert report.compressed.max_batch > report.full.max_batch
    assert report.peak_ratio == report.compressed.peak_bytes / report.full.peak_bytes < 0.7
    assert report.max_batch_ratio == report.compressed.max_batch / report.full.max_batch

    tiny = measure_rollout_memory(
        model, tokenizer, PROMPTS, compression, max_new_tokens=new_tokens, kv_cap_bytes=1, batch_size=1
    )
    assert tiny.full.max_batch == tiny.compressed.max_batch == 0  # not even one rollout fits in one byte

    doc = json.loads(report.save(tmp_path / "report.json").read_text())
    assert doc["max_batch_ratio"] == pytest.approx(report.max_batch_ratio)
    assert doc["compressed"]["max_batch"] == report.compressed.max_batch
    assert "| compressed |" in report.to_markdown()


def test_importance_ratio_measures_the_compressed_vs_full_attention_mismatch(make_model, tokenizer):
    model = make_model("llama")
    new_tokens = 48

    def ratio(sparsity):
        compression = CompressedRolloutConfig(
            head_mask=HeadMask.random(model), sparsity=sparsity, sink=2, window=8, protect_prompt=False
        )
        report = measure_rollout_memory(
            model,
            tokenizer,
            PROMPTS,
            compression,
            max_new_tokens=new_tokens,
            kv_cap_bytes=2**30,
            batch_size=3,
            max_batch_limit=3,
        )
        assert report.compressed.peak_allocated_bytes is None and report.device == "cpu"  # CUDA only
        assert "importance-sampling ratio p_full/p_rollout" in report.to_markdown()
        return report.importance_ratio

    exact, evicting = ratio(0.0), ratio(0.75)
    assert exact.tokens == evicting.tokens == 3 * new_tokens  # every sampled token of the reference batch
    # nothing compressed: the rollout's log-probs are the teacher-forced full-attention ones
    assert exact.mean_abs_logp_diff < 1e-4 and exact.min == pytest.approx(1, abs=1e-3)
    # streaming heads that dropped tokens: rollout and loss see different distributions
    assert evicting.mean_abs_logp_diff > 100 * max(exact.mean_abs_logp_diff, 1e-6)
    assert evicting.min < 1 < evicting.max


def test_report_on_the_static_cache_counts_its_capacity(make_model, tokenizer):
    """With the static-shape cache the compressed rollouts' resident and peak bytes are the tensors it
    allocated (capacity: full heads hold every column it can take), and the report names the cache;
    the sampled tokens' importance ratios are the dynamic cache's."""
    model = make_model("llama")
    compression = CompressedRolloutConfig(head_mask=HeadMask.random(model), sparsity=0.5, sink=2, window=8)
    reports = {
        static: measure_rollout_memory(
            model,
            tokenizer,
            PROMPTS,
            compression,
            max_new_tokens=40,
            kv_cap_bytes=2**30,
            batch_size=3,
            max_batch_limit=3,
            static_cache=static,
        )
        for static in (False, True)
    }
    static, dynamic = reports[True], reports[False]
    assert (static.compression["cache"], dynamic.compression["cache"]) == ("static", "dynamic")
    assert (
        static.compressed.peak_bytes == static.compressed.resident_bytes > dynamic.compressed.resident_bytes
    )
    assert static.full == dynamic.full  # the full reference is a stock DynamicCache either way
    assert astuple(static.importance_ratio) == pytest.approx(astuple(dynamic.importance_ratio), abs=1e-5)
