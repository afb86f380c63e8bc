"""Rollout KV memory report (rlkv.rollout.memory): compressed vs full, every number from real runs."""

import json

import pytest

from rlkv.head_mask import HeadMask
from rlkv.rollout import CompressedRolloutConfig
from rlkv.rollout.memory import measure_rollout_memory

PROMPTS = ["let x be 3 then x + 4", "solve the following math problem", "wait"]


def test_memory_report_max_batch_and_peaks_are_measured(tmp_path, make_model, tokenizer):
    model = make_model("llama")
    compression = CompressedRolloutConfig(head_mask=HeadMask.random(model), sparsity=0.75, sink=2, window=8)
    new_tokens = 96
    # cap: what 3 full-cache rollouts need, measured by a first report run
    probe = measure_rollout_memory(
        model, tokenizer, PROMPTS, compression, max_new_tokens=new_tokens, kv_cap_bytes=1, batch_size=3
    )
    assert probe.full.max_batch == probe.compressed.max_batch == 0  # nothing fits in one byte
    cap = probe.full.peak_bytes

    report = measure_rollout_memory(
        model, tokenizer, PROMPTS, compression, max_new_tokens=new_tokens, kv_cap_bytes=cap, batch_size=3
    )
    for m in (report.full, report.compressed):
        b = m.max_batch
        assert m.probes[b] <= cap < m.probes[b + 1]  # b fits, b + 1 was run and does not
    assert report.full.max_batch == 3
    assert report.compressed.max_batch > report.full.max_batch
    assert report.full.peak_bytes == probe.full.peak_bytes  # same run conditions, same bytes
    # full-cache peak: every layer and KV head holds prompt + generated tokens (the last token is never fed)
    prompt_len = max(report.prompt_tokens)
    assert report.full.peak_bytes == 3 * 2 * 2 * 2 * (prompt_len + new_tokens - 1) * 16 * 4
    assert report.peak_ratio == report.compressed.peak_bytes / report.full.peak_bytes < 0.7
    assert report.max_batch_ratio == report.compressed.max_batch / report.full.max_batch

    doc = json.loads(report.save(tmp_path / "report.json").read_text())
    assert doc["max_batch_ratio"] == pytest.approx(report.max_batch_ratio)
    assert doc["compressed"]["max_batch"] == report.compressed.max_batch
    assert "| compressed |" in report.to_markdown()
