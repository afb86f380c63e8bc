"""The head-mixed architectures: vLLM's Llama, Qwen2 and Qwen3 with each layer's attention split by `HeadSplit`.

Each class is the stock vLLM model (subclassed, not patched) whose decoder `Attention` modules are
replaced, once the stock model is built, by `HeadMixedAttention` over the split read from
`config.rlkv_head_split`. The split changes no parameter's shape; `load_weights` (through which vLLM's
loaders and in-place reloads pass) permutes each split layer's attention weights into the served head
order (`head_order.py`) and hands them to the stock loader. `check_engine` refuses, at engine start,
what the split cannot honour.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from rlkv.vllm_plugin.attention import split_attention_layers
from rlkv.vllm_plugin.fence import check_vllm_api
from rlkv.vllm_plugin.split import HeadSplit, HeadSplitError, check_full_attention_layers

# a child of vLLM's logger, so the line goes where vLLM's own logs go (and VLLM_LOGGING_LEVEL applies)
_LOG = logging.getLogger("vllm.rlkv")
PREFIX_CACHING_WARNING = (
    "rlkv: prefix caching gives no hits on a model with token eviction (compactions rewrite the compressed "
    "heads' blocks), it only hashes them: start the engine with enable_prefix_caching=False "
    "(--no-enable-prefix-caching)"
)


def check_engine(vllm_config: Any) -> HeadSplit:
    """The split of the model being built, after refusing engine settings it cannot honour (one line each)."""
    config = vllm_config.model_config.hf_config
    split = HeadSplit.from_config(config)
    check_vllm_api()
    if vllm_config.use_v2_model_runner:
        raise HeadSplitError(
            "vLLM's model runner V2 passes no is_prefilling or positions to attention builders, which rlkv's "
            "compressed heads read: start the engine with VLLM_USE_V2_MODEL_RUNNER=0 (the V1 runner)"
        )
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise HeadSplitError(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: rlkv's head split is served with tensor "
            "parallelism only; use tensor_parallel_size instead"
        )
    context = {
        "decode_context_parallel_size": parallel.decode_context_parallel_size,
        "prefill_context_parallel_size": parallel.prefill_context_parallel_size,
    }
    for name, size in context.items():
        if size > 1:
            raise HeadSplitError(
                f"{name}={size}: context parallelism splits a request's tokens over ranks, which rlkv's "
                "compressed heads (sink, window, kept slots per request) do not follow; set it to 1"
            )
    if vllm_config.kv_transfer_config is not None:
        raise HeadSplitError(
            "kv_transfer_config is set: a KV connector moves stock-layout blocks between engines, and rlkv's "
            "compressed groups hold rings and compacted slots; serve without a KV connector"
        )
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    split.check_shards(num_kv_heads, parallel.tensor_parallel_size)
    if vllm_config.quant_config is not None:
        raise HeadSplitError(
            f"quantization {vllm_config.model_config.quantization!r}: rlkv permutes each layer's attention heads "
            "as the weights load, which packed quantized weights do not allow; serve an unquantized checkpoint"
        )
    if vllm_config.lora_config is not None:
        raise HeadSplitError(
            "enable_lora is set: LoRA adapters are in the stock head order and rlkv serves its heads permuted; "
            "merge the adapter into the weights and serve the merged model"
        )
    if vllm_config.speculative_config is not None:
        raise HeadSplitError(
            "speculative_config is set: rlkv's head-mixed models do not serve speculative decoding; drop it"
        )
    check_full_attention_layers(config)
    return split


class _HeadMixed:
    """The head split over a stock vLLM model class (the class after this one in the bases)."""

    def __init__(self, *, vllm_config: Any, prefix: str = ""):
        split = check_engine(vllm_config)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        self.rlkv_head_order = split_attention_layers(self, split, num_kv_heads)
        _LOG.info(split.describe(num_kv_heads, type(self).__name__))
        if split.policy is not None and vllm_config.cache_config.enable_prefix_caching:
            _LOG.warning(PREFIX_CACHING_WARNING)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The stock loader over `weights` with each split layer's attention weights in the served order."""
        return super().load_weights(self.rlkv_head_order.weights(weights))


class RlkvLlamaForCausalLM(_HeadMixed, LlamaForCausalLM):
    """vLLM's `LlamaForCausalLM` with the head split of `config.rlkv_head_split`."""


class RlkvQwen2ForCausalLM(_HeadMixed, Qwen2ForCausalLM):
    """vLLM's `Qwen2ForCausalLM` with the head split of `config.rlkv_head_split`."""


class RlkvQwen3ForCausalLM(_HeadMixed, Qwen3ForCausalLM):
    """vLLM's `Qwen3ForCausalLM` with the head split of `config.rlkv_head_split`."""
