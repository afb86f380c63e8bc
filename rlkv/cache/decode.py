"""Single-token attention over a long history on CPU, split along the keys so every thread works.

A decode step packs each KV head's G query heads as G query rows of one SDPA head
(`rlkv.cache.attention`). torch's CPU flash kernel hands out (batch row, head) pairs to threads, so
when B x H_kv pairs do not divide among the threads some threads idle: 5 full KV heads on 2 threads
take as long as 6, which a head mask at sparsity 0.5 makes common. Splitting the keys into S equal
parts along the sequence gives B x H_kv x S pairs that do divide; the parts' outputs are merged
with their log-sum-exp (as flash-decoding does), equal to one pass up to float rounding.
"""

from __future__ import annotations

import torch

from rlkv.compat import cpu_flash_attention_with_lse

# Each part keeps at least this many keys: below it the extra kernel call and the merge cost more
# than an idle thread.
MIN_SPLIT_TOKENS = 1024


def decode_splits(keys: torch.Tensor, values: torch.Tensor, threads: int | None = None) -> int:
    """How many parts to split `keys`/`values` [B, H_kv, T, D] into for one decode step (1: do not split).

    The smallest S that minimises the per-thread share of parts, ceil(B * H_kv * S / threads) / S,
    with at least MIN_SPLIT_TOKENS keys per part; only on CPU, and only for layouts whose (row, head)
    pairs are equally spaced in memory (so S views of them need no copy).
    """
    batch, heads, length, _ = keys.shape
    if length < 2 * MIN_SPLIT_TOKENS:  # no part could keep its minimum: decided before anything costlier
        return 1
    threads = threads or torch.get_num_threads()
    if keys.device.type != "cpu" or threads < 2 or cpu_flash_attention_with_lse() is None:
        return 1
    if not all(t.stride(0) == heads * t.stride(1) for t in (keys, values)):
        return 1
    items = batch * heads
    best, best_units = 1, -(-items // threads)
    for splits in range(2, min(threads, length // MIN_SPLIT_TOKENS) + 1):
        units = -(-items * splits // threads)  # parts per thread, each 1/splits of the work
        if units * best < best_units * splits:
            best, best_units = splits, units
    return best


def split_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, splits: int
) -> torch.Tensor:
    """Attention [B, H_kv, G, D] of `query` [B, H_kv, G, D] over `keys`/`values` [B, H_kv, T, D], no mask,
    computed as `splits` parts along T (plus the T % splits last keys) merged by log-sum-exp."""
    batch, heads, length, dim = keys.shape
    chunk = length // splits
    parts = [(_parts_view(keys, splits, chunk), _parts_view(values, splits, chunk))]
    if length > splits * chunk:
        tail = slice(splits * chunk, length)
        parts.append((keys[:, :, tail].flatten(0, 1)[None], values[:, :, tail].flatten(0, 1)[None]))
    flat_query = query.flatten(0, 1)[None]
    flash = cpu_flash_attention_with_lse()
    outs, lses = [], []
    for part_keys, part_values in parts:
        out, lse = flash(
            flat_query.expand(part_keys.shape[0], -1, -1, -1), part_keys, part_values, scale=scale
        )
        outs.append(out)
        lses.append(lse)
    weights = torch.softmax(torch.cat(lses), dim=0)  # [parts, B * H_kv, G]: each part's share
    merged = (torch.cat(outs).float() * weights[..., None]).sum(0)
    return merged.to(query.dtype).view(batch, heads, -1, dim)


def _parts_view(tensor: torch.Tensor, splits: int, chunk: int) -> torch.Tensor:
    """[splits, B * H_kv, chunk, D] view of the first splits * chunk tokens of `tensor` [B, H_kv, T, D]."""
    _, head_stride, token_stride, dim_stride = tensor.stride()
    size = (splits, tensor.shape[0] * tensor.shape[1], chunk, tensor.shape[3])
    return tensor.as_strided(size, (chunk * token_stride, head_stride, token_stride, dim_stride))
