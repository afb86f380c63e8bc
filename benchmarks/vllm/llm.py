"""The `vllm.LLM` the vLLM suite's parts start: fp32, eager, blocks of 32, an explicit KV size, no prefix cache."""

from __future__ import annotations

from typing import Any


def bench_llm(model: str, max_model_len: int, kv_bytes: int, overrides: dict | None, **extra: Any) -> Any:
    """An engine of `model` (random token ids: no tokenizer) with rlkv's `overrides` (None: stock vLLM)."""
    import vllm

    return vllm.LLM(
        model=model,
        dtype="float32",
        enforce_eager=True,
        block_size=32,
        seed=0,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=kv_bytes,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        hf_overrides=overrides or {},
        **extra,
    )
