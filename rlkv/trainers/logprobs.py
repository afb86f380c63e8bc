"""Per-token log-probabilities (and entropies) of the completion tokens, through a frozen LM head.

GRPO's loss needs `log p(token)` of every completion token under the model; the logits over the
vocabulary (151,936 for Qwen2.5) are the largest tensors of a step. `token_logps` never holds
more than `chunk` tokens' logits: the forward keeps only each token's log-normaliser, and the
backward recomputes a chunk's logits and turns them into the gradient of the hidden states with
one matmul in the weights' dtype (bf16 matmuls accumulate in fp32 inside the kernel); the
logits are kept instead when they fit a memory budget. The LM head
is frozen (RLKV trains only the gates), so no weight gradient is formed. Softmax statistics are fp32.

Why our own: TRL's fused head (`trl.kernels.chunked_logprob`) accumulates its backward GEMMs in
fp32 by upcasting both operands, which on a CPU without Triton costs 3.5x our backward (16.2 s vs
4.7 s for 2048 tokens x 151,936 vocab, bf16, 2 cores), and scores the prompt positions too.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_KEEP_LOGITS_BYTES = 512 * 2**20  # logits kept for the backward when they fit (else recomputed)


class _TokenLogProbs(torch.autograd.Function):
    """hidden [N, H], weight [V, H] (frozen), targets [N] -> (log_probs [N], entropy [N]) in fp32."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_temperature, chunk, with_entropy, keep_bytes):
        n, vocab = hidden.shape[0], weight.shape[0]
        logps = hidden.new_empty(n, dtype=torch.float32)
        log_z = hidden.new_empty(n, dtype=torch.float32)
        entropy = hidden.new_empty(n, dtype=torch.float32) if with_entropy else None
        # The head's matmul is the costliest part; its output (in the weights' dtype, exactly what a
        # recomputation would give) is kept for the backward when it fits `keep_bytes`.
        kept = weight.new_empty(n, vocab) if n * vocab * weight.element_size() <= keep_bytes else None
        for start in range(0, n, chunk):
            sl = slice(start, start + chunk)
            raw = _chunk_matmul(hidden[sl], weight, bias)
            if kept is not None:
                kept[sl] = raw
            z = raw.float().mul_(inv_temperature)  # [C, V] fp32
            lz = torch.logsumexp(z, dim=-1)
            log_z[sl] = lz
            logps[sl] = z.gather(-1, targets[sl, None])[:, 0] - lz
            if with_entropy:
                p = (z - lz[:, None]).exp_()
                entropy[sl] = lz - torch.linalg.vecdot(p, z)
        ctx.save_for_backward(hidden, weight, bias, targets, log_z, entropy, kept)
        ctx.inv_temperature, ctx.chunk = inv_temperature, chunk
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, bias, targets, log_z, entropy, kept = ctx.saved_tensors
        if not ctx.needs_input_grad[0] or (grad_logps is None and grad_entropy is None):
            return (None,) * 8
        inv_t = ctx.inv_temperature
        grad_hidden = torch.empty_like(hidden)
        for start in range(0, hidden.shape[0], ctx.chunk):
            sl = slice(start, start + ctx.chunk)
            raw = kept[sl] if kept is not None else _chunk_matmul(hidden[sl], weight, bias)
            log_p = raw.float().mul_(inv_t).sub_(log_z[sl, None])
            p = log_p.exp()
            # d log p_t / dz_j = 1[j = t] - p_j;  dH/dz_j = -p_j (log p_j + H);  dz/dlogits = 1/T
            if grad_entropy is not None:
                grad_z = log_p.add_(entropy[sl, None]).mul_(p).mul_(-grad_entropy[sl, None] * inv_t)
                if grad_logps is not None:
                    g = grad_logps[sl, None].float() * inv_t
                    grad_z.sub_(p.mul_(g)).scatter_add_(1, targets[sl, None], g)
            else:
                g = grad_logps[sl, None].float() * inv_t
                grad_z = p.mul_(-g).scatter_add_(1, targets[sl, None], g)
            grad_hidden[sl] = (grad_z.to(weight.dtype) @ weight).to(hidden.dtype)
        return (grad_hidden,) + (None,) * 7


def _chunk_matmul(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = hidden.to(weight.dtype) @ weight.t()
    return z if bias is None else z + bias


def token_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = DEFAULT_CHUNK_TOKENS,
    keep_logits_bytes: int = DEFAULT_KEEP_LOGITS_BYTES,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`log_softmax(hidden @ weight.T / temperature)[targets]` and the entropy of that distribution.

    hidden [..., H] (any dtype; gradients flow back to it), weight [V, H] and bias [V] frozen,
    targets [...] token ids. Returns fp32 tensors of targets' shape (entropy None unless asked).
    The head's logits (N x V in the weights' dtype) are kept for the backward when they take at
    most `keep_logits_bytes`, which saves one matmul; otherwise the backward recomputes them.
    """
    if weight.requires_grad or (bias is not None and bias.requires_grad):
        raise ValueError("token_logps: the LM head must be frozen (weight/bias requires_grad=False)")
    if temperature <= 0:
        raise ValueError(f"temperature={temperature}: must be > 0")
    shape = targets.shape
    flat_h = hidden.reshape(-1, hidden.shape[-1])
    logps, entropy = _TokenLogProbs.apply(
        flat_h, weight, bias, targets.reshape(-1), 1.0 / temperature, chunk, with_entropy, keep_logits_bytes
    )
    return logps.view(shape), None if entropy is None else entropy.view(shape)


def completion_logps(
    model: torch.nn.Module,
    lm_head: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    logits_to_keep: int,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    chunk: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs [B, logits_to_keep] (and entropies) of the last `logits_to_keep` tokens of each row.

    `model` is called as is (a DDP/FSDP wrapper keeps its gradient hooks) with
    `output_hidden_states=True, logits_to_keep=1`, so the vocabulary logits of every position are
    never formed; the final (normed) hidden states predicting the kept tokens go through `lm_head`.
    """
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        output_hidden_states=True,
        logits_to_keep=1,
        use_cache=False,
    )
    hidden = out.hidden_states[-1][:, -logits_to_keep - 1 : -1]
    targets = input_ids[:, -logits_to_keep:]
    return token_logps(
        hidden,
        lm_head.weight,
        targets,
        bias=lm_head.bias,
        temperature=temperature,
        with_entropy=with_entropy,
        chunk=chunk,
    )
