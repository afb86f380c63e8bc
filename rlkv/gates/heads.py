"""Learnable per-(layer, KV head) gates that switch a frozen model to RLKV's mixed attention
(rlkv/gates/attention.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from rlkv.errors import UserError
from rlkv.gates import attention as mixed_attention
from rlkv.geometry import attention_geometry, text_config
from rlkv.ranking import rank_heads


class UnsupportedModelError(ValueError, UserError):
    """The model's attention layers do not expose what head-level gating needs."""


def full_alpha(alpha: torch.Tensor) -> torch.Tensor:
    """The whole gate tensor [L, H_kv] on this rank, differentiable where the backend allows.

    Plain tensors pass through; an FSDP2 DTensor is all-gathered (a collective: call on every
    rank); a DeepSpeed ZeRO-3 parameter must be persistent (L * H_kv below
    `stage3_param_persistence_threshold`), which gate tensors are unless the threshold is tiny.
    """
    from torch.distributed.tensor import DTensor

    if isinstance(alpha, DTensor):
        return alpha.full_tensor()
    status = getattr(alpha, "ds_status", None)
    if status is not None and "NOT_AVAILABLE" in str(status):
        raise RuntimeError(
            "DeepSpeed ZeRO-3 partitioned the gate tensor rlkv_gates.alpha; set "
            f"zero_optimization.stage3_param_persistence_threshold above {int(alpha.ds_numel)} so it stays whole"
        )
    return alpha


class HeadGates(nn.Module):
    """One gate `alpha[l, h]` in [0, 1] per layer and KV head.

    alpha: nn.Parameter FloatTensor[L, H_kv]; 1 = full attention, 0 = sink+local attention.
    sink/local: token counts of the local branch (training: 128/256, RLKV's defaults).
    below_zero: FloatTensor[L, H_kv] buffer, <= 0: what `clamp_` cut off below 0, summed over
    its calls (how hard and how long the optimizer pushed each gate under 0). The clamp makes
    every such gate exactly 0.0; this ranks them (`HeadMask.tie_break`: nearer 0 = more important).
    hard_keep: None (default) or a head count k: the forward runs the deployed mask instead of the
    soft mix, the top k gates (ties by `below_zero`, as the exported mask ranks them) at 1 and the
    rest at 0, with the gradient of the soft gates (straight-through; see `forward_alpha`).
    """

    def __init__(
        self, num_layers: int, num_kv_heads: int, sink: int = 128, local: int = 256, init: float = 1.0
    ):
        super().__init__()
        if sink < 0 or local < 1:
            raise ValueError(f"sink={sink}, local={local}: need sink >= 0 and local >= 1")
        if not 0.0 <= init <= 1.0:
            raise ValueError(f"init={init} must be in [0, 1] (the gate's range)")
        self.sink = int(sink)
        self.local = int(local)
        self.alpha = nn.Parameter(torch.full((num_layers, num_kv_heads), float(init)))
        # not in the model's state_dict: gate checkpoints save it themselves (gates.safetensors)
        self.register_buffer("below_zero", torch.zeros(num_layers, num_kv_heads), persistent=False)
        self.bypassed = False  # True inside `full_attention`: the model runs its stock attention
        self.hard_keep: int | None = None

    def forward_alpha(self, layer: int) -> torch.Tensor:
        """The gates layer `layer`'s forward mixes with, FloatTensor[H_kv] in [0, 1], differentiable in `alpha`.

        Soft (`hard_keep` None): alpha clamped to [0, 1]. Hard: the layer's row of the 0/1 layout of
        the mask that keeps the `hard_keep` top gates full, plus `alpha - alpha.detach()`, so the loss
        is that of the layout a deployment would use while each gate gets the gradient of moving its
        head toward full (or local) attention from there. No host read.
        """
        if self.hard_keep is None:
            return self.alpha[layer].clamp(0.0, 1.0)
        soft = full_alpha(self.alpha).clamp(0.0, 1.0)
        chosen = rank_heads(soft.detach(), self.below_zero.to(soft.device))[: self.hard_keep]
        hard = torch.zeros(soft.numel(), dtype=soft.dtype, device=soft.device).index_fill_(0, chosen, 1.0)
        return (hard.view_as(soft) + (soft - soft.detach()))[layer]

    @torch.no_grad()
    def clamp_(self) -> HeadGates:
        """Project alpha onto [0, 1] in place (the reference implementations do this before each forward);
        what is cut off below 0 is added to `below_zero`."""
        self.below_zero += full_alpha(self.alpha.detach()).clamp(max=0.0).to(self.below_zero)
        self.alpha.clamp_(0.0, 1.0)
        return self

    def extra_repr(self) -> str:
        hard = "" if self.hard_keep is None else f", hard_keep={self.hard_keep}"
        return (
            f"layers={self.alpha.shape[0]}, kv_heads={self.alpha.shape[1]}, "
            f"sink={self.sink}, local={self.local}{hard}"
        )


def _contiguous_input(module: nn.Module, args: tuple) -> tuple | None:
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.dim() > 2 and not x.is_contiguous():
        return (x.contiguous(), *args[1:])
    return None


def contiguous_head_inputs(model: PreTrainedModel):
    """Make the LM head's input contiguous before it runs; returns the hook handle (or None, no head).

    Why: a model's forward slices its last hidden state (`logits_to_keep`) into a non-contiguous
    [B, 1, d] view. With a frozen head weight, torch's `linear` does not fold such an input into one
    matmul but broadcasts the weight to [B, d, V] and copies it: on Qwen2.5-0.5B (V = 151936) that
    is 272 MiB and ~2 s of copying per row, per call (58 s and 8.7 GB for 32 rows). A copy of the
    [B, 1, d] input costs nothing by comparison.
    """
    head = model.get_output_embeddings()
    return None if head is None else head.register_forward_pre_hook(_contiguous_input)


def attention_layers(model: nn.Module) -> list[nn.Module]:
    """The self-attention modules of `model` in layer order, checked for what gating needs."""
    layers = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups")]
    expected = getattr(text_config(model), "num_hidden_layers", None)
    if not layers or expected is None or len(layers) != expected:
        raise UnsupportedModelError(
            f"{type(model).__name__}: found {len(layers)} attention modules with `layer_idx` and "
            f"`num_key_value_groups` (config says {expected} layers). rlkv gates need transformers attention "
            "modules of the Llama / Qwen2 / Qwen3 / Mistral kind (GQA attributes, AttentionInterface dispatch)."
        )
    if sorted(m.layer_idx for m in layers) != list(range(expected)):
        raise UnsupportedModelError(
            f"{type(model).__name__}: attention layer_idx values are not 0..{expected - 1}"
        )
    return sorted(layers, key=lambda m: m.layer_idx)


def attach_gates(model: PreTrainedModel, sink: int = 128, local: int = 256, init: float = 1.0) -> HeadGates:
    """Add RLKV gates to `model`, freeze every model weight and switch it to mixed attention.

    The gates become the submodule `model.rlkv_gates` (so optimizers, checkpoints and DDP see them)
    and are the only trainable tensor. Works in training forwards and in `generate`. Returns the gates.
    """
    if hasattr(model, "rlkv_gates"):
        raise ValueError("model already has rlkv gates; call rlkv.detach_gates(model) first")
    layers = attention_layers(model)
    num_kv = attention_geometry(model).num_key_value_heads
    param = next(model.parameters())
    gates = HeadGates(len(layers), num_kv, sink=sink, local=local, init=init).to(param.device)
    for p in model.parameters():
        p.requires_grad_(False)
    model.add_module("rlkv_gates", gates)
    model._rlkv_head_hook = contiguous_head_inputs(model)  # the head is frozen from here on
    for layer in layers:
        # a plain attribute, not a submodule: one gate tensor, no duplicate state-dict entries per layer
        object.__setattr__(layer, "_rlkv_gates", gates)
    model._rlkv_previous_attn = model.config._attn_implementation
    model.set_attn_implementation(mixed_attention.register())
    return gates


@contextlib.contextmanager
def full_attention(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Inside the block, the gated `model` runs its stock attention (every head full, gates ignored).

    The full-attention reference of the distillation and KL terms: the same frozen weights, no second
    copy of the model. Gradients still flow to anything else the forward uses; the gates get none.
    """
    gates = getattr(model, "rlkv_gates", None)
    if gates is None:
        raise ValueError("model has no rlkv gates: attach them with rlkv.attach_gates first")
    previous, gates.bypassed = gates.bypassed, True
    try:
        yield model
    finally:
        gates.bypassed = previous


def detach_gates(model: PreTrainedModel) -> HeadGates:
    """Remove the gates and restore the attention implementation the model had before; returns the gates."""
    if not hasattr(model, "rlkv_gates"):
        raise ValueError("model has no rlkv gates to detach")
    gates = model.rlkv_gates
    for layer in attention_layers(model):
        object.__delattr__(layer, "_rlkv_gates")
    del model.rlkv_gates
    if model._rlkv_head_hook is not None:
        model._rlkv_head_hook.remove()
    del model._rlkv_head_hook
    model.set_attn_implementation(model._rlkv_previous_attn)
    del model._rlkv_previous_attn
    return gates
