"""rlkv's vLLM plugin: head-mixed forms of vLLM's Llama, Qwen2 and Qwen3, registered with stock vLLM.

vLLM calls `register` through the `vllm.general_plugins` entry point of this package (declared in
pyproject.toml) in every engine process. It registers the architectures of `split.ARCHITECTURES`
lazily (by module path: nothing of vLLM's model code is imported until a model names one). A model
selects one with `architectures` and carries the split under `rlkv_head_split` (`split.py`), both
from `hf_overrides` or its folder's `config.json`. This room reads only that plain data; its token-eviction
group (`eviction.py`, only where a split names a policy) runs rlkv's own policies and schedule
(`rlkv.policies`, `rlkv.cache.static.budget`), so both engines make the same decisions.
"""

from __future__ import annotations

from rlkv.vllm_plugin import lifetime
from rlkv.vllm_plugin.split import ARCHITECTURES

# modules of this room that subclass vLLM's classes, so import only where vLLM is installed
VLLM_ONLY_MODULES = (
    "rlkv.vllm_plugin.eviction",
    "rlkv.vllm_plugin.eviction_backend",
    "rlkv.vllm_plugin.eviction_compaction",
    "rlkv.vllm_plugin.eviction_stock",
    "rlkv.vllm_plugin.meter",
    "rlkv.vllm_plugin.models",
    "rlkv.vllm_plugin.ring",
    "rlkv.vllm_plugin.ring_backend",
    "rlkv.vllm_plugin.sink_window",
    "rlkv.vllm_plugin.sink_window_backend",
)


def register() -> None:
    """Register the head-mixed architectures with vLLM's `ModelRegistry` (idempotent); in the processes of
    an rlkv command, tie them to that command's life (`lifetime.py`)."""
    from vllm import ModelRegistry

    lifetime.install()
    from rlkv.vllm_plugin.eviction import register_eviction
    from rlkv.vllm_plugin.ring import register_ring
    from rlkv.vllm_plugin.sink_window import register_sink_window

    register_sink_window()
    register_ring()
    register_eviction()

    known = set(ModelRegistry.get_supported_archs())
    for name in ARCHITECTURES.values():
        if name not in known:
            ModelRegistry.register_model(name, f"rlkv.vllm_plugin.models:{name}")
