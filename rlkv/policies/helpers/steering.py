"""SkipKV's adaptive steering: a vector added to one decoder layer's output at sentence delimiters.

The vector is `v = mean(H_exec) - mean(H_nonexec)`: the mean hidden state (output of decoder layer
`layer`) of execution sentences minus that of non-execution sentences (sentences holding one of the
keywords "Wait", "Alternatively", "again"), each sentence represented by the mean over its tokens.
During generation with `skipkv`, at every generated delimiter token the policy adds
`alpha_t * v` to that layer's output, `alpha_t = alpha0 + gamma * N_nonexec` per row.

The hook is a plain forward hook on the decoder layer (no class patching); it reads the policy
from the `HeadMixedCache` passed to the layer, so forwards without one are untouched.

File format (JSON, written atomically): {"format": "rlkv-steering-v1", "layer": int,
"hidden_size": int, "model": str, "num_execution": int, "num_non_execution": int, "vector": [...]}.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlkv._io import atomic_write_text
from rlkv.compat import forward_cache
from rlkv.errors import UserError
from rlkv.geometry import text_config
from rlkv.policies.helpers.sentences import (
    DELIMITERS,
    NON_EXECUTION_KEYWORDS,
    delimiter_token_mask,
    sentence_spans,
)

STEERING_FORMAT = "rlkv-steering-v1"


class SteeringError(ValueError, UserError):
    """A malformed steering-vector file, or one that does not fit the model."""


@dataclass
class SteeringVector:
    """A steering direction for the output of decoder layer `layer` (0-based): vector FloatTensor [hidden]."""

    vector: torch.Tensor
    layer: int
    model: str = ""
    num_execution: int = 0
    num_non_execution: int = 0

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON file atomically."""
        payload = {
            "format": STEERING_FORMAT,
            "layer": int(self.layer),
            "hidden_size": int(self.vector.numel()),
            "model": self.model,
            "num_execution": int(self.num_execution),
            "num_non_execution": int(self.num_non_execution),
            "vector": [float(x) for x in self.vector.float().tolist()],
        }
        return atomic_write_text(path, json.dumps(payload))

    @classmethod
    def load(cls, path: str | os.PathLike) -> SteeringVector:
        """Read a file written by `save`; `SteeringError` says what is wrong with a bad one."""
        try:
            payload = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise SteeringError(f"cannot read steering vector {path}: {e}") from None
        if not isinstance(payload, dict) or payload.get("format") != STEERING_FORMAT:
            raise SteeringError(
                f"{path} is not an rlkv steering vector (expected format {STEERING_FORMAT!r})"
            )
        vector, layer = payload.get("vector"), payload.get("layer")
        if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
            raise SteeringError(f"{path}: 'layer' must be a decoder layer index >= 0, got {layer!r}")
        if not isinstance(vector, list) or not vector or not all(isinstance(x, (int, float)) for x in vector):
            raise SteeringError(f"{path}: 'vector' must be a non-empty list of numbers")
        if not all(math.isfinite(x) for x in vector):
            raise SteeringError(f"{path}: 'vector' holds non-finite values")
        if payload.get("hidden_size", len(vector)) != len(vector):
            raise SteeringError(
                f"{path}: 'hidden_size' {payload.get('hidden_size')} != len(vector) {len(vector)}"
            )
        return cls(
            vector=torch.tensor(vector, dtype=torch.float32),
            layer=layer,
            model=str(payload.get("model", "")),
            num_execution=int(payload.get("num_execution", 0)),
            num_non_execution=int(payload.get("num_non_execution", 0)),
        )

    def check_compatible(self, model: torch.nn.Module) -> None:
        """Raise `SteeringError` unless the layer exists and the hidden size matches `model`."""
        config = text_config(model)
        if self.vector.numel() != config.hidden_size:
            raise SteeringError(
                f"steering vector has {self.vector.numel()} values but the model's hidden_size is {config.hidden_size}"
                f" (vector made for {self.model or 'another model'!r})"
            )
        if self.layer >= config.num_hidden_layers:
            raise SteeringError(
                f"steering layer {self.layer} does not exist: the model has {config.num_hidden_layers} decoder layers"
            )


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise SteeringError(f"{type(model).__name__} has no decoder.layers to steer")
    return layers


def install_steering(model: torch.nn.Module, steering: SteeringVector) -> None:
    """Register (once per layer) the forward hook that adds the active SkipKV policy's steering delta."""
    steering.check_compatible(model)
    hooks = model.__dict__.setdefault("_rlkv_steering_hooks", {})
    layer_idx = int(steering.layer)
    if layer_idx in hooks:
        return

    def add_steering(module, args, kwargs, output):
        # a HeadMixedCache exposes its policy; any other cache (or none) passes through untouched
        policy = getattr(forward_cache(kwargs), "policy", None)
        if getattr(policy, "steering", None) is None or policy.steering.layer != layer_idx:
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        delta = policy.steering_delta(hidden)
        if delta is None:
            return None
        return (hidden + delta, *output[1:]) if isinstance(output, tuple) else hidden + delta

    hooks[layer_idx] = _decoder_layers(model)[layer_idx].register_forward_hook(add_steering, with_kwargs=True)


@torch.no_grad()
def compute_steering_vector(
    model: torch.nn.Module,
    tokenizer: Any,
    texts: Iterable[str],
    layer: int,
    delimiters: Sequence[str] | None = None,
    keywords: Sequence[str] | None = None,
    max_length: int | None = None,
) -> SteeringVector:
    """`mean(H_exec) - mean(H_nonexec)` at the output of decoder layer `layer`, over sentences of `texts`.

    Each text (a reasoning trace) is tokenised without special tokens, run through the model, split
    into sentences at delimiter tokens; a sentence is non-execution when its text holds a keyword;
    its representation is the mean hidden state of its tokens.
    """
    keywords = tuple(NON_EXECUTION_KEYWORDS if keywords is None else keywords)
    is_delimiter = delimiter_token_mask(tokenizer, DELIMITERS if delimiters is None else delimiters)
    layers = _decoder_layers(model)
    if not 0 <= layer < len(layers):
        raise SteeringError(f"layer={layer}: the model has {len(layers)} decoder layers (0-based index)")
    captured: list[torch.Tensor] = []

    def capture(module, args, output):
        captured.append((output[0] if isinstance(output, tuple) else output).detach())

    handle = layers[layer].register_forward_hook(capture)
    sums = {True: None, False: None}
    counts = {True: 0, False: 0}
    device = next(model.parameters()).device
    try:
        for text in texts:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if max_length is not None:
                ids = ids[:max_length]
            if not ids:
                continue
            captured.clear()
            model(input_ids=torch.tensor([ids], device=device), use_cache=False)
            hidden = captured[0][0].float()  # [T, hidden]
            for start, end in sentence_spans(ids, is_delimiter):
                non_exec = any(k in tokenizer.decode(ids[start:end]) for k in keywords)
                mean = hidden[start:end].mean(dim=0)
                sums[non_exec] = mean if sums[non_exec] is None else sums[non_exec] + mean
                counts[non_exec] += 1
    finally:
        handle.remove()
    if counts[False] == 0 or counts[True] == 0:
        raise SteeringError(
            f"need both execution and non-execution sentences (found {counts[False]} and {counts[True]}); "
            f"non-execution sentences contain one of {list(keywords)}"
        )
    vector = sums[False] / counts[False] - sums[True] / counts[True]
    return SteeringVector(
        vector=vector.cpu(),
        layer=layer,
        model=str(getattr(model.config, "_name_or_path", "")),
        num_execution=counts[False],
        num_non_execution=counts[True],
    )
