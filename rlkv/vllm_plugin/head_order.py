"""Heads permuted at load: each split layer holds its full KV heads first and its compressed ones after.

A head split names arbitrary KV heads of a layer (`HeadSplit.full_kv_heads`); picking them out of q, k
and v at every step would cost an `index_select` per part and an `index_copy_` of the output. Instead the
checkpoint's attention weights are permuted once, as they stream into the model: the rows of q_proj,
k_proj and v_proj (and their biases) and the columns of o_proj, by whole KV heads (a KV head carries its
`groups` query heads). Attention is the same function of the input (o_proj sums the same products in
another order), and each kind of head is a contiguous slice of q/k/v, a view. Every weight load goes
through `load_weights`, so vLLM's in-place reloads (RL weight sync) are permuted the same way.
Torch only: no vLLM import.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

# a decoder layer's attention weight, as checkpoints of Llama, Qwen2 and Qwen3 name it
_ATTENTION_WEIGHT = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$")


class HeadOrder:
    """Per split layer, the stock KV-head index at each served position; permutes checkpoint weights to it.

    orders: layer -> the stock KV head at served position 0, 1, ... (layers absent keep the stock order).
    groups: query heads per KV head. head_size: features per head.
    """

    def __init__(self, orders: dict[int, tuple[int, ...]], groups: int, head_size: int):
        identity = {layer for layer, order in orders.items() if order == tuple(range(len(order)))}
        self.orders = {layer: torch.tensor(order) for layer, order in orders.items() if layer not in identity}
        self.groups, self.head_size = groups, head_size

    def permute(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (checkpoint weight `name`) in the served head order; other weights unchanged.

        q_proj weight [H_q * D, hidden] and bias [H_q * D]; k_proj / v_proj [H_kv * D, hidden] and [H_kv * D];
        o_proj weight [hidden, H_q * D] (permuted along its columns).
        """
        match = _ATTENTION_WEIGHT.search(name)
        order = self.orders.get(int(match.group(1))) if match else None
        if order is None or match.group(2, 3) == ("o", "bias"):  # o_proj's bias is per feature, not per head
            return tensor
        proj = match.group(2)
        per_head = self.head_size * (self.groups if proj in "qo" else 1)
        if proj == "o":
            rows = tensor.shape[0]
            return tensor.view(rows, -1, per_head).index_select(1, order).reshape(rows, -1)
        return tensor.view(-1, per_head, *tensor.shape[1:]).index_select(0, order).reshape(tensor.shape)

    def weights(self, stream: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs of `stream`, each attention weight in the served head order."""
        for name, tensor in stream:
            yield name, self.permute(name, tensor)
