"""RLKV's gated mixed attention, as a transformers attention function.

Per KV head h of layer l: `out = alpha[l, h] * full_attn + (1 - alpha[l, h]) * sink_local_attn`,
where sink+local attention lets a query see the first `sink` (non-padding) tokens of its row and
the last `local` tokens up to and including itself. Query heads of a GQA group share their KV
head's gate. Two paths give the same result:
- with gradients on the gates (training), the full branch is transformers' own SDPA attention, so
  alpha = 1 reproduces the stock model, and the sink+local branch costs O(T * (sink + 2 * local))
  per head, never a dense T x T;
- a single-token decode step without gradients computes its scores once and both softmaxes read
  them (`mixed_attention_shared_scores`): one QK^T and one PV, as plain attention does, instead
  of two attention passes and the block bookkeeping of the local branch.
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface

from rlkv.attention_masks import decode_mask
from rlkv.compat import tensor_version

ATTENTION_NAME = "rlkv_mixed"
SCORE_CHUNK_ELEMENTS = 1 << 24  # float32 scores held at once by the shared-scores path (64 MiB)


def key_validity(attention_mask: torch.Tensor | None, batch: int, kv_len: int, device) -> torch.Tensor:
    """BoolTensor[B, K]: which key columns are real tokens, read from a 4D boolean (or additive) mask.

    The last query row of a causal mask sees every earlier key that is not padding, so it carries
    the key-padding pattern (transformers' padding mask acts on key columns only).
    """
    if attention_mask is None:
        return torch.ones(batch, kv_len, dtype=torch.bool, device=device)
    last = attention_mask[:, 0, -1, :kv_len]
    valid = last if last.dtype == torch.bool else last == 0
    return valid.expand(batch, kv_len)


def sink_local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    sink: int,
    local: int,
    scaling: float,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal sink+local attention for the last Q of K positions.

    query [B, H, Q, D], key/value [B, H_kv, K, D] (GQA not repeated), valid BoolTensor[B, K] marks
    real keys (left padding = False). A query at position i (queries are positions K-Q..K-1) sees
    key j iff j <= i, valid[j], and (j is among the first `sink` valid keys of its row, or i - j < local).
    Returns [B, Q, H, D]. Queries are cut into blocks of C <= local; each block attends, in one
    batched SDPA call, to the row's sink keys plus a window of C + local - 1 keys, so the cost is
    O(Q * (sink + C + local)) per head and no score matrix is kept for the backward pass.
    """
    bsz, n_heads, q_len, dim = query.shape
    kv_len = key.shape[2]
    device = query.device
    if valid is None:
        valid = torch.ones(bsz, kv_len, dtype=torch.bool, device=device)
    q_start = kv_len - q_len
    block = max(1, min(local, q_len))
    n_blocks = -(-q_len // block)
    q_pad = n_blocks * block - q_len
    width = block + local - 1

    # Sink keys: the first `sink` valid keys of each row (left padding shifts them right).
    lead_pad = (~valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    n_sink = min(sink, kv_len)
    sink_idx = lead_pad[:, None] + torch.arange(n_sink, device=device)  # [B, S]
    sink_exists = sink_idx < kv_len
    sink_idx = sink_idx.clamp_max(kv_len - 1)
    gather = sink_idx[:, None, :, None].expand(bsz, key.shape[1], n_sink, dim)
    k_sink, v_sink = key.gather(2, gather), value.gather(2, gather)

    # Window b covers keys [q_start + b*C - local + 1, q_start + (b+1)*C); pad so indices start at 0.
    lead = local - 1 - q_start
    k_src, v_src, valid_src = key, value, valid
    if lead < 0:  # keys no query can reach through the band
        k_src, v_src, valid_src = key[:, :, -lead:], value[:, :, -lead:], valid[:, -lead:]
        lead = 0
    pad = torch.nn.functional.pad
    k_win = (
        pad(k_src, (0, 0, lead, q_pad)).unfold(2, width, block).permute(0, 2, 1, 4, 3)
    )  # [B, NB, H_kv, W, D]
    v_win = pad(v_src, (0, 0, lead, q_pad)).unfold(2, width, block).permute(0, 2, 1, 4, 3)
    valid_win = pad(valid_src, (lead, q_pad), value=False).unfold(1, width, block)  # [B, NB, W]

    expand = (bsz, n_blocks) + k_sink.shape[1:]
    k_all = torch.cat([k_sink[:, None].expand(expand), k_win], dim=3).flatten(0, 1)  # [B*NB, H_kv, S+W, D]
    v_all = torch.cat([v_sink[:, None].expand(expand), v_win], dim=3).flatten(0, 1)

    q_pos = (q_start + torch.arange(n_blocks * block, device=device)).view(n_blocks, block)  # [NB, C]
    sink_ok = (
        (sink_idx[:, None, None, :] <= q_pos[None, :, :, None])
        & (q_pos[None, :, :, None] - sink_idx[:, None, None, :] >= local)  # else the window holds it
        & (sink_exists & valid.gather(1, sink_idx))[:, None, None, :]
    )  # [B, NB, C, S]
    rel = (
        torch.arange(width, device=device)[None, :]
        - (local - 1)
        - torch.arange(block, device=device)[:, None]
    )
    band_ok = ((rel <= 0) & (rel > -local))[None, None] & valid_win[:, :, None, :]  # [B, NB, C, W]
    allowed = torch.cat([sink_ok, band_ok], dim=-1).flatten(0, 1)[:, None]  # [B*NB, 1, C, S+W]
    # additive mask: fully masked (padding) query rows get a uniform, finite softmax instead of NaN
    bias = torch.zeros(allowed.shape, dtype=query.dtype, device=device).masked_fill_(
        ~allowed, torch.finfo(query.dtype).min
    )
    q_blk = pad(query, (0, 0, 0, q_pad)).view(bsz, n_heads, n_blocks, block, dim).transpose(1, 2)
    out = torch.nn.functional.scaled_dot_product_attention(
        q_blk.flatten(0, 1), k_all, v_all, attn_mask=bias, scale=scaling, enable_gqa=True
    )  # [B*NB, H, C, D]
    out = out.view(bsz, n_blocks, n_heads, block, dim).permute(0, 1, 3, 2, 4).reshape(bsz, -1, n_heads, dim)
    return out[:, :q_len]


def mixed_attention_shared_scores(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    alpha: torch.Tensor,
    sink: int,
    local: int,
    scaling: float,
    attention_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The gated mix from one set of scores per query chunk (no autograd graph kept).

    query [B, H, Q, D] (Q query positions among K key columns), key/value [B, H_kv, K, D], alpha [H_kv],
    attention_mask a 4D boolean/additive mask [B, 1, Q, >=K] or None (causal, no padding).
    Full attention sees what the mask allows; sink+local attention additionally requires the key
    to be among the first `sink` valid keys of its row or within `local` of the query. With a mask,
    each query's own column is the last key it may see (keys may run past the queries: the empty
    slots of a static cache). Without one, the queries read "no mask" as transformers' SDPA call
    does: a single query sees every key (it is the last column); several are causal from the
    first column (SDPA's `is_causal`, how transformers prefills a static cache), which are the last
    columns when there are as many keys as queries.
    Softmax in float32. Queries of a GQA group share their KV head's keys without copies.
    Returns [B, Q, H, D].
    """
    bsz, n_heads, q_len, dim = query.shape
    n_kv, kv_len = key.shape[1], key.shape[2]
    groups = n_heads // n_kv
    a = alpha.float()[None, :, None, None, None]  # [1, H_kv, 1, 1, 1]
    q = query.view(bsz, n_kv, groups, q_len, dim)
    # Keys and values stay [B, H_kv, K, D]: the G query heads of a group are stacked as rows of one
    # matmul, so the cache is read in place (a broadcast over G would copy it G times per layer).
    k_t = key.transpose(-1, -2)  # [B, H_kv, D, K]
    step = max(1, SCORE_CHUNK_ELEMENTS // max(1, bsz * n_heads * kv_len))
    bands = _band_masks(attention_mask, bsz, q_len, kv_len, step, sink, local, query.device)
    neg = torch.finfo(torch.float32).min
    outs = []
    for start, (allowed, allowed_local) in zip(range(0, q_len, step), bands, strict=True):
        stop = min(q_len, start + step)
        rows = stop - start
        q_rows = q[:, :, :, start:stop].reshape(bsz, n_kv, groups * rows, dim)
        scores = ((q_rows @ k_t).float() * scaling).view(bsz, n_kv, groups, rows, kv_len)
        p_full = scores.masked_fill(~allowed[:, None, None], neg).softmax(-1)
        p_local = scores.masked_fill_(~allowed_local[:, None, None], neg).softmax(-1)
        probs = p_local.mul_(1 - a).add_(p_full.mul_(a))
        mixed = probs.to(value.dtype).view(bsz, n_kv, groups * rows, kv_len) @ value
        outs.append(mixed.view(bsz, n_kv, groups, rows, dim))  # [B, H_kv, G, C, D]
    out = torch.cat(outs, dim=3).view(bsz, n_heads, q_len, dim)
    return out.transpose(1, 2)


# The band masks of the last single-chunk call (a decode step): transformers hands every layer of a
# forward the same mask tensor, so the layers after the first reuse them instead of recomputing about
# fifteen small ops each (fifteen kernel launches per layer on a GPU). Keyed by a weak reference to the
# mask (a freed mask never matches a new one at the same address) and its in-place version.
_last_band: list = [None]


def _band_masks(
    attention_mask: torch.Tensor | None,
    bsz: int,
    q_len: int,
    kv_len: int,
    step: int,
    sink: int,
    local: int,
    device: torch.device,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(allowed, allowed_local) per chunk of `step` queries: bool [B or 1, C, K] masks of full and of
    sink+local attention (see `mixed_attention_shared_scores`), from the last call when it had the
    same mask and sizes."""
    # an inference-mode mask keeps no version counter: a change in place could not be seen
    memo = q_len <= step and not torch.compiler.is_compiling()
    memo = memo and (attention_mask is None or not attention_mask.is_inference())
    if memo:
        version = None if attention_mask is None else tensor_version(attention_mask)
        key = (bsz, q_len, kv_len, sink, local, device, version)
        last = _last_band[0]
        if last is not None and last[1] == key and (last[0]() if last[0] else None) is attention_mask:
            return last[2]
    valid = key_validity(attention_mask, bsz, kv_len, device)  # [B, K]
    lead_pad = (~valid).long().cumprod(dim=1).sum(dim=1)  # [B]
    k_pos = torch.arange(kv_len, device=device)
    is_sink = (k_pos[None, :] >= lead_pad[:, None]) & (k_pos[None, :] < lead_pad[:, None] + sink)  # [B, K]
    bands = []
    for start in range(0, q_len, step):
        stop = min(q_len, start + step)
        if attention_mask is None:
            first = kv_len - 1 if q_len == 1 else 0  # the single query's column, or SDPA's top-left
            q_pos = first + torch.arange(start, stop, device=device)  # [C]
            allowed = (k_pos[None, :] <= q_pos[:, None])[None]  # [1, C, K]
            in_band = ((q_pos[:, None] - k_pos[None, :]) < local)[None]  # [1, C, K]
        else:
            m = attention_mask[:, 0, start:stop, :kv_len]
            allowed = m if m.dtype == torch.bool else m == 0  # [B, C, K]
            q_col = torch.where(allowed, k_pos, -1).amax(-1, keepdim=True)  # [B, C, 1]: the query's own
            in_band = (q_col - k_pos) < local  # [B, C, K]
        bands.append((allowed, allowed & (in_band | is_sink[:, None, :])))  # [B, C, K]
    if memo:
        ref = None if attention_mask is None else weakref.ref(attention_mask)
        _last_band[0] = (ref, key, bands)
    return bands


def mixed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """AttentionInterface function: alpha-weighted mix of full SDPA and sink+local attention.

    Reads the layer's gates from `module._rlkv_gates` (set by `attach_gates`); a module without gates
    (e.g. another model sharing the same config object) or inside `full_attention` runs stock SDPA.
    Returns ([B, Q, H, D], None).
    """
    gates = getattr(module, "_rlkv_gates", None)
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if gates is None or gates.bypassed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    alpha = gates.forward_alpha(module.layer_idx)  # [H_kv]
    needs_grad = torch.is_grad_enabled() and (
        alpha.requires_grad or query.requires_grad or key.requires_grad or value.requires_grad
    )
    # Only cached forwards take the shared-scores path: single-token decode steps, and forwards whose
    # keys run past their queries (a static cache's prefill: `sink_local_attention` assumes the
    # queries are the last columns). A forward over a whole sequence (training, activation-checkpoint
    # recomputation, scoring without gradients) always runs the same two-branch kernels, so its
    # numbers do not depend on whether gradients are on.
    single = query.shape[2] == 1
    cached = single or key.shape[2] > query.shape[2]
    if cached and not needs_grad and not (dropout > 0 and module.training):
        if (
            single and gates.hard_keep is None and stock_layers(gates)[module.layer_idx]
        ):  # exactly the stock attention, and as fast
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        out = mixed_attention_shared_scores(
            query, key, value, alpha, gates.sink, gates.local, scaling, attention_mask
        )
        return out, None
    full, _ = sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    valid = key_validity(attention_mask, query.shape[0], key.shape[2], query.device)
    local = sink_local_attention(query, key, value, gates.sink, gates.local, scaling, valid)
    groups = query.shape[1] // key.shape[1]
    a = alpha.to(full.dtype).repeat_interleave(groups)[None, None, :, None]  # per query head
    return a * full + (1 - a) * local, None


def stock_layers(gates: torch.nn.Module) -> list[bool]:
    """Per layer, whether every gate is >= 1 (clamped: 1, the layer is exactly the stock attention),
    as Python bools. Read from the device only when `gates.alpha` changed (a new tensor, or its
    in-place version counter moved: an optimizer step, `clamp_`, a loaded state), so a decode
    step makes no host sync for it. Inside `torch.compile` the last eager reading is used."""
    cached = getattr(gates, "_rlkv_stock_layers", None)
    if torch.compiler.is_compiling():
        # traced: the flags of the last eager step become constants of the graph, guarded by value
        # (gates that change make a recompile); before any eager step, every layer takes the mix
        return cached[1] if cached is not None else [False] * gates.alpha.shape[0]
    alpha = gates.alpha
    key = (id(alpha), alpha.data_ptr(), tensor_version(alpha))
    if cached is None or cached[0] != key:
        cached = (key, (alpha.detach() >= 1).all(dim=1).tolist())
        gates._rlkv_stock_layers = cached
    return cached[1]


def register() -> str:
    """Register the mixed attention and its mask function with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, mixed_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, decode_mask)
    return ATTENTION_NAME
