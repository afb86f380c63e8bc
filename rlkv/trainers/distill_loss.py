"""The distillation term: KL(full attention || gated) of each completion token's next-token distribution.

`forward_kl` never holds more than `chunk` tokens' vocabulary logits: the forward keeps only the
final hidden states of both models, and the backward recomputes a chunk's two distributions and
turns `q - p` into the gradient of the gated hidden states with one matmul through the frozen head
(d KL(p || q) / d z_q = q - p). `distill_kl` runs the reference forward through the same weights
with the gates switched off (`rlkv.gates.full_attention`), so no second copy of the model exists.
"""

from __future__ import annotations

import math

import torch

from rlkv.data.batches import TeacherForcedBatch
from rlkv.gates import full_attention
from rlkv.trainers.logprobs import DEFAULT_CHUNK_TOKENS, _chunk_matmul


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _chunk_matmul(hidden, weight, bias).float()  # softmax statistics in fp32 whatever the head's dtype


class _ForwardKL(torch.autograd.Function):
    """hidden [N, H] (gated), ref [N, H] (full), weight [V, H] frozen -> KL(p_ref || q) [N] in fp32."""

    @staticmethod
    def forward(ctx, hidden, ref, weight, bias, chunk):
        kl = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk):
            sl = slice(start, start + chunk)
            log_q = torch.log_softmax(_logits(hidden[sl], weight, bias), dim=-1)
            log_p = torch.log_softmax(_logits(ref[sl], weight, bias), dim=-1)
            kl[sl] = torch.linalg.vecdot(log_p.exp(), log_p - log_q)
        ctx.save_for_backward(hidden, ref, weight, bias)
        ctx.chunk = chunk
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        hidden, ref, weight, bias = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return (None,) * 5
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            q = torch.softmax(_logits(hidden[sl], weight, bias), dim=-1)
            p = torch.softmax(_logits(ref[sl], weight, bias), dim=-1)
            grad_z = q.sub_(p).mul_(grad_kl[sl, None].float())
            grad_hidden[sl] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
        return grad_hidden, None, None, None, None


def forward_kl(
    hidden: torch.Tensor,
    ref_hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """Per-token `KL(softmax(ref_hidden @ W.T) || softmax(hidden @ W.T))` in nats, FloatTensor[N].

    hidden / ref_hidden [N, H]: final hidden states of the gated and of the full-attention model;
    weight [V, H] and bias [V]: the frozen LM head. Gradients flow to `hidden` only.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("forward_kl: the LM head must be frozen (weight/bias requires_grad=False)")
    if hidden.shape != ref_hidden.shape:
        raise ValueError(f"forward_kl: hidden {tuple(hidden.shape)} and ref {tuple(ref_hidden.shape)} differ")
    return _ForwardKL.apply(hidden, ref_hidden.detach(), weight, bias, chunk)


def final_hidden(model: torch.nn.Module, batch: TeacherForcedBatch) -> torch.Tensor:
    """The final (normed) hidden states [N, H] at the positions that predict `batch`'s completion tokens.

    `model` is called as is (a DDP wrapper keeps its gradient hooks), with `logits_to_keep=1` so the
    vocabulary logits of every position are never formed.
    """
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    return out.hidden_states[-1][batch.rows, batch.cols]


def reference_hidden(
    model: torch.nn.Module, gated_model: torch.nn.Module, batch: TeacherForcedBatch
) -> torch.Tensor:
    """`final_hidden` of the full-attention model: `gated_model` (unwrapped, with `rlkv_gates`) with its gates off."""
    with torch.no_grad(), full_attention(gated_model):
        return final_hidden(model, batch)


def distill_kl(
    model: torch.nn.Module,
    gated_model: torch.nn.Module,
    batch: TeacherForcedBatch,
    ref_hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per completion token, KL(full attention || gated model) in nats: FloatTensor[N], differentiable in the gates.

    `model` is called as is; `gated_model` is the unwrapped model carrying `rlkv_gates`. `ref_hidden`
    ([N, H], `reference_hidden` of this batch) skips the reference forward when the caller kept it.
    """
    if ref_hidden is None:
        ref_hidden = reference_hidden(model, gated_model, batch)
    hidden = final_hidden(model, batch)
    head = gated_model.get_output_embeddings()
    return forward_kl(hidden, ref_hidden, head.weight, head.bias)


def top_fraction_kl(values: torch.Tensor, fraction: float) -> torch.Tensor:
    """Sum of the ceil(fraction * N) largest entries of `values` [N] over N (fraction 1: the plain mean):
    the mean with the smallest entries' share dropped, so it stays on the mean's scale (a penalty weight
    tuned against the mean keeps its meaning); differentiable through the entries it keeps."""
    if fraction >= 1.0:
        return values.mean()
    count = max(1, math.ceil(fraction * values.numel()))
    return values.topk(count).values.sum() / values.numel()
