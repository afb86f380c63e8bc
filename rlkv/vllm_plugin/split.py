"""The head split a vLLM engine serves, as plain data in the model's config (no torch, no vLLM, nothing outside
this room).

A head-mixed architecture (`RlkvLlamaForCausalLM`, ...) reads `config.rlkv_head_split`:

    {"format": 1, "full_kv_heads": [[0], [1], [], ...], "sink": 16, "window": 64, "prompt": "full"}

`full_kv_heads[l]` lists the KV heads of layer l that keep their whole history; every other KV head of
that layer attends to its first `sink` tokens, its last `window` tokens and the current one (rlkv's
streaming heads). `prompt` "full" (rlkv's eval form): a prompt query attends the whole prompt, the
compression starts with the first generated token; "protected": the same, and the prompt is never
evicted (compressed heads keep it whole besides sink + window); "window" (the default when absent): the
prompt is windowed too. Sink 0 with a windowed prompt is vLLM's own sliding window of `window + 1` tokens;
every other form is rlkv's sink/window KV cache group (`sink_window.py`). The split reaches vLLM as
`hf_overrides` (`rlkv.inference.vllm_overrides`) or in a prepared model folder's `config.json`
(`rlkv export-vllm`). `HeadSplit.from_config` checks it against the model's geometry and raises
`HeadSplitError` naming the field and the fix.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from rlkv.vllm_plugin.groups import bucket_of_parts, plan_groups

CONFIG_KEY = "rlkv_head_split"
FORMAT = 1
# the stock architecture -> its head-mixed form registered by the plugin
ARCHITECTURES = {
    "LlamaForCausalLM": "RlkvLlamaForCausalLM",
    "Qwen2ForCausalLM": "RlkvQwen2ForCausalLM",
    "Qwen3ForCausalLM": "RlkvQwen3ForCausalLM",
}


# policies the eviction group runs: their decisions need only the slots' keys, values and positions, the last
# observation queries and, for H2O, the attention each slot received (`observed.py`); SkipKV's tokens and
# RPC's cycles are not carried
EVICTION_POLICIES = ("h2o", "knorm", "random", "rkv", "sink-recent", "snapkv")


KERNELS = ("stock", "torch")  # `HeadSplit.kernel`


class HeadSplitError(ValueError):
    """A head split that does not fit the model or the engine (the message names the field and the fix)."""


# hf_overrides keys that decide the split or the geometry it is checked against: rlkv sets or reads them
SPLIT_KEYS = ("architectures", CONFIG_KEY, "num_hidden_layers", "num_attention_heads", "num_key_value_heads")


def check_full_attention_layers(config: Any) -> None:
    """Refuse a model (transformers config or dict) whose own layers use sliding windows (Qwen2's option):
    the split serves models whose every layer attends fully."""
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    if get("sliding_window") and get("use_sliding_window", True):
        if "sliding_attention" in set(get("layer_types") or []):
            raise HeadSplitError(
                f"config.sliding_window={get('sliding_window')} with sliding layers (use_sliding_window=True): "
                "rlkv's head split serves models whose layers all attend fully; serve this model without "
                "a head mask, or set use_sliding_window=false if the model was trained without it"
            )


@dataclass(frozen=True)
class EvictionRule:
    """Token eviction on the compressed heads: a policy (`EVICTION_POLICIES`) at a budget.

    budget: evictable tokens a head keeps (int) or the ratio of the request's real tokens (float in
    (0, 1], plus sink + window); kwargs: the policy's constructor arguments as canonical JSON.
    """

    name: str
    budget: int | float
    kwargs: str = "{}"

    def layer_kwargs(self, split: HeadSplit) -> dict[str, Any]:
        """The arguments of an `EvictionAttention` part of `split`."""
        return dict(
            policy=self.name,
            policy_kwargs=self.kwargs,
            budget=self.budget,
            sink=split.sink,
            window=split.window,
            protect_prompt=split.protect_prompt,
        )

    def to_config(self) -> dict[str, Any]:
        return {"name": self.name, "budget": self.budget, "kwargs": json.loads(self.kwargs)}

    @classmethod
    def from_config(cls, raw: Any) -> EvictionRule:
        """Read and check `rlkv_head_split.policy`; `HeadSplitError` names the field and the fix."""
        where = f"{CONFIG_KEY}.policy"
        if not isinstance(raw, dict):
            raise HeadSplitError(
                f"{where} must be a mapping with name, budget and kwargs, got {type(raw).__name__}"
            )
        name, budget, kwargs = raw.get("name"), raw.get("budget"), raw.get("kwargs", {})
        if name not in EVICTION_POLICIES:
            raise HeadSplitError(
                f"{where}.name={name!r}: vLLM's eviction group runs {', '.join(EVICTION_POLICIES)}; serve other "
                "policies with rlkv's transformers engine"
            )
        ratio = isinstance(budget, float) and 0.0 < budget <= 1.0
        count = isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0
        if not (ratio or count):
            raise HeadSplitError(
                f"{where}.budget={budget!r}: an integer >= 0 (tokens per head) or a float in (0, 1] (the ratio of "
                "the request's tokens)"
            )
        if not isinstance(kwargs, dict):
            raise HeadSplitError(f"{where}.kwargs={kwargs!r}: the policy's constructor arguments, a mapping")
        return cls(name, budget, json.dumps(kwargs, sort_keys=True))


def check_kv_heads_divide(num_kv_heads: int, shards: int) -> None:
    """`HeadSplitError` unless `shards` (vLLM's tensor-parallel size) is a positive integer dividing the
    model's KV heads per layer (vLLM gives each rank an equal share of every layer's KV heads)."""
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise HeadSplitError(f"tensor_parallel_size={shards!r}: a positive integer (vLLM's ranks)")
    if num_kv_heads % shards:
        raise HeadSplitError(
            f"tensor_parallel_size={shards}: the model's {num_kv_heads} KV heads per layer do not divide "
            "among the ranks; use a size that divides them"
        )


@dataclass(frozen=True)
class HeadSplit:
    """Which KV heads of each layer keep a full cache; the rest keep a window of `window` past tokens.

    full_kv_heads: per layer, the sorted KV-head indices served with full attention.
    window: past tokens a compressed head attends besides the current one (rlkv's `window`).
    sink: first tokens a compressed head keeps. full_prompt: prompt queries attend the whole prompt.
    protect_prompt: compressed heads keep the whole prompt too (implies full_prompt).
    policy: token eviction on the compressed heads (`EvictionRule`) instead of the sink + window form.
    kernel: "stock" runs the full-prompt sink + window form on the platform's own attention kernel where
    rlkv has its ring for that platform (`ring.py`); "torch" runs rlkv's gather form (`sink_window.py`), the
    exact reference.
    """

    full_kv_heads: tuple[tuple[int, ...], ...]
    window: int
    sink: int = 0
    full_prompt: bool = False
    protect_prompt: bool = False
    policy: EvictionRule | None = None
    kernel: str = "stock"

    @property
    def uses_ring(self) -> bool:
        """True when the form can run as a ring (`ring.py`): the prompt read in full (kept or not), no policy."""
        return self.full_prompt and self.policy is None and self.kernel == "stock"

    @property
    def is_sliding_window(self) -> bool:
        """True when the form is vLLM's own sliding window (sink 0, the prompt windowed)."""
        return self.sink == 0 and not self.full_prompt and self.policy is None

    @property
    def num_layers(self) -> int:
        return len(self.full_kv_heads)

    @property
    def vllm_sliding_window(self) -> int:
        """Tokens vLLM's sliding window holds, the current one included: `window + 1`."""
        return self.window + 1

    def compressed_kv_heads(self, layer: int, num_kv_heads: int) -> tuple[int, ...]:
        """KV heads of `layer` served with the window, in order."""
        full = set(self.full_kv_heads[layer])
        return tuple(h for h in range(num_kv_heads) if h not in full)

    def served_order(self, layer: int, num_kv_heads: int, shards: int = 1) -> tuple[int, ...]:
        """The stock KV head at each position of `layer` as served (the order its attention weights are
        permuted to at load): per shard (tensor-parallel rank, in rank order) its share of the full heads,
        then its share of the compressed ones. vLLM gives rank r the KV heads at positions
        [r * H / shards, (r + 1) * H / shards), so every rank holds full heads first, then compressed ones.
        """
        full, compressed = self.full_kv_heads[layer], self.compressed_kv_heads(layer, num_kv_heads)
        f, c = len(full) // shards, len(compressed) // shards
        return sum((full[r * f : (r + 1) * f] + compressed[r * c : (r + 1) * c] for r in range(shards)), ())

    def check_shards(self, num_kv_heads: int, shards: int) -> None:
        """`HeadSplitError` unless every layer's full and compressed heads divide evenly among `shards`
        tensor-parallel ranks (so every rank builds the same KV cache groups)."""
        check_kv_heads_divide(num_kv_heads, shards)
        for layer, full in enumerate(self.full_kv_heads):
            if len(full) % shards:
                raise HeadSplitError(
                    f"tensor_parallel_size={shards}: layer {layer} has {len(full)} full KV heads, not a multiple "
                    f"of {shards}, so its heads cannot be split evenly among the ranks; cut the mask for "
                    f"{shards} shards (HeadMask.full_heads(sparsity, shards={shards}), vllm_overrides(..., "
                    f"tensor_parallel_size={shards}), rlkv serve --tensor-parallel-size {shards})"
                )

    def unit(self, num_kv_heads: int, shards: int = 1) -> int:
        """KV heads per vLLM attention module on one rank: the gcd of every layer's full and compressed head
        counts per rank (`shards` tensor-parallel ranks, each holding 1 / shards of either kind).

        Equal-sized modules give every KV cache group the same page size, so vLLM's hybrid KV cache
        manager forms one group per kind (and per multiple of the smaller kind's layer count) instead of
        one group per distinct head count.
        """
        counts = []
        for layer, full in enumerate(self.full_kv_heads):
            counts += [len(full) // shards, len(self.compressed_kv_heads(layer, num_kv_heads)) // shards]
        return math.gcd(*[c for c in counts if c]) or num_kv_heads // shards

    def compressed_buckets(self, num_kv_heads: int, shards: int = 1) -> dict[tuple[int, int], int]:
        """The spec bucket of each compressed part, keyed (layer, part index in the layer) (`groups.plan_groups`:
        buckets laid out so that vLLM's KV cache groups pad no full-attention part). The window-only form
        runs vLLM's own sliding-window spec, which has no bucket: all 0."""
        unit = self.unit(num_kv_heads, shards)
        parts = [
            (layer, i)
            for layer in range(self.num_layers)
            for i in range(len(self.compressed_kv_heads(layer, num_kv_heads)) // shards // unit)
        ]
        if self.is_sliding_window:
            return dict.fromkeys(parts, 0)
        full = sum(len(heads) // shards // unit for heads in self.full_kv_heads)
        return dict(zip(parts, bucket_of_parts(plan_groups(full, len(parts))), strict=True))

    def describe(self, num_kv_heads: int, architecture: str) -> str:
        """One line for logs: how many KV heads are full and what the others keep."""
        full = sum(len(heads) for heads in self.full_kv_heads)
        total = self.num_layers * num_kv_heads
        if self.policy is not None:
            return (
                f"rlkv: {architecture} serves {full} of {total} KV heads full, {total - full} with {self.policy.name} "
                f"eviction at budget {self.policy.budget} (sink {self.sink}, window {self.window}, prompt "
                f"{self.prompt_mode})"
            )
        return (
            f"rlkv: {architecture} serves {full} of {total} KV heads full, {total - full} with a window of "
            f"{self.window} + 1 tokens (sink {self.sink}, prompt {self.prompt_mode})"
        )

    def to_config(self) -> dict[str, Any]:
        """The plain-data form stored under `config.rlkv_head_split`."""
        return (
            {
                "format": FORMAT,
                "full_kv_heads": [list(heads) for heads in self.full_kv_heads],
                "sink": self.sink,
                "window": self.window,
                "prompt": self.prompt_mode,
            }
            | ({"policy": self.policy.to_config()} if self.policy is not None else {})
            | ({"kernel": self.kernel} if self.kernel != "stock" else {})
        )

    @property
    def prompt_mode(self) -> str:
        """The `prompt` value of the plain-data form: "protected", "full" or "window"."""
        return "protected" if self.protect_prompt else "full" if self.full_prompt else "window"

    @classmethod
    def from_config(cls, config: Any) -> HeadSplit:
        """Read and check `config.rlkv_head_split` (a transformers config, or a dict) against its geometry."""
        get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
        raw = get(CONFIG_KEY)
        if raw is None:
            raise HeadSplitError(
                f"config has no {CONFIG_KEY}: pass hf_overrides=rlkv.inference.vllm_overrides(...) or serve a "
                "folder made by `rlkv export-vllm`"
            )
        if not isinstance(raw, dict):
            raise HeadSplitError(f"{CONFIG_KEY} must be a mapping, got {type(raw).__name__}")
        if raw.get("format") != FORMAT:
            raise HeadSplitError(
                f"{CONFIG_KEY}.format={raw.get('format')!r}: this rlkv reads format {FORMAT}; re-export the split"
            )
        layers = int(get("num_hidden_layers"))
        kv_heads = int(get("num_key_value_heads") or get("num_attention_heads"))
        full = raw.get("full_kv_heads")
        if not isinstance(full, list) or len(full) != layers:
            got = len(full) if isinstance(full, list) else type(full).__name__
            raise HeadSplitError(
                f"{CONFIG_KEY}.full_kv_heads has {got} layers, the model {layers}: the split was made for "
                "another model; build it from a mask of this model"
            )
        for layer, heads in enumerate(full):
            ok = isinstance(heads, list) and all(isinstance(h, int) and 0 <= h < kv_heads for h in heads)
            if not ok or len(set(heads)) != len(heads):
                raise HeadSplitError(
                    f"{CONFIG_KEY}.full_kv_heads[{layer}]={heads!r}: must list distinct KV heads in "
                    f"[0, {kv_heads}) (the model has {kv_heads} KV heads per layer)"
                )
        for name in ("window", "sink"):
            value = raw.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise HeadSplitError(f"{CONFIG_KEY}.{name}={value!r}: must be an integer >= 0")
        prompt = raw.get("prompt", "window")
        if prompt not in ("full", "protected", "window"):
            raise HeadSplitError(
                f"{CONFIG_KEY}.prompt={prompt!r}: must be 'full' (prompt read whole), 'protected' (read and kept "
                "whole) or 'window' (prompt windowed)"
            )
        policy = EvictionRule.from_config(raw["policy"]) if raw.get("policy") is not None else None
        kernel = raw.get("kernel", "stock")
        if kernel not in KERNELS:
            raise HeadSplitError(
                f"{CONFIG_KEY}.kernel={kernel!r}: must be 'stock' (the platform's attention kernel where rlkv "
                "supports it) or 'torch' (rlkv's exact torch reference)"
            )
        if policy is not None and prompt == "window":
            raise HeadSplitError(
                f"{CONFIG_KEY}.prompt='window' with a policy: the eviction group reads the prompt whole; set "
                "prompt to 'full' (evictable) or 'protected'"
            )
        return cls(
            tuple(tuple(sorted(h)) for h in full),
            window=raw["window"],
            sink=raw["sink"],
            full_prompt=prompt != "window",
            protect_prompt=prompt == "protected",
            policy=policy,
            kernel=kernel,
        )
