"""Growth of cache tensors along the token axis (dim 2), shared by the full heads and the compressed store.

`append_along_tokens` grows a tensor by at most 1/GROWTH_DIVISOR spare tokens, so a decode step copies
no history; a store under `SMALL_STORE_BYTES` of keys is copied by one cheaper `cat` instead.
"""

from __future__ import annotations

import torch

# Storage grows along the token axis by 1/GROWTH_DIVISOR of what it holds: at most 1/128 (0.8%) of
# the bytes are spare capacity, and each token is copied O(1) times amortised instead of the whole
# history once per decode step.
GROWTH_DIVISOR = 128
# Below this many bytes of keys a store grows by one `torch.cat` per append, exactly sized: one op that
# copies 64 KiB costs less than the two ops of a write into spare capacity (and the reallocation every
# few steps of a store just past 128 tokens); measured 2026-11-28, single thread: 144 tokens x 2 heads
# x 64 dims fp32 (72 KiB) cat 2.9 us vs write 8.5 us, 512 tokens (256 KiB) 12.4 vs 6.5 us.
SMALL_STORE_BYTES = 64 * 1024


def grows_in_place(keys: torch.Tensor | None) -> bool:
    """Whether a store whose keys are `keys` appends into spare capacity (else by one `torch.cat`): from
    `SMALL_STORE_BYTES` on, decided from the keys so every tensor of the store grows alike."""
    return keys is None or keys.nbytes >= SMALL_STORE_BYTES


def append_along_tokens(
    capacity: torch.Tensor | None, current: torch.Tensor | None, new: torch.Tensor, in_place: bool = True
) -> torch.Tensor:
    """Append `new` [B, H, Q, ...] after `current` [B, H, T, ...] along dim 2; returns the storage that holds both.

    `capacity` is the storage `current` is a prefix view of (or None: `current` is exactly sized).
    When it has no room, a new storage of `(T + Q) * (1 + 1/GROWTH_DIVISOR)` tokens (rounded down)
    is allocated and `current` copied in once. Callers attend to / expose the prefix view
    `result[:, :, :T + Q]`; `resident_bytes()` counts the whole storage. Under 128 tokens, or with
    `in_place` False (`grows_in_place`), `current` grows by one exactly sized `torch.cat` instead.
    """
    used = 0 if current is None else current.shape[2]
    needed = used + new.shape[2]
    if current is not None and (needed < GROWTH_DIVISOR or not in_place):
        return torch.cat([current, new], dim=2)  # short stores (compressed heads): one op, no spare
    if capacity is None or needed > capacity.shape[2]:
        spare = needed // GROWTH_DIVISOR
        capacity = new.new_empty((*new.shape[:2], needed + spare, *new.shape[3:]))
        if used:
            capacity[:, :, :used] = current
    capacity[:, :, used:needed] = new
    return capacity


def token_prefix(storage: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens (dim 2) of `storage`: the storage itself when that is all of it (no view op)."""
    return storage if storage.shape[2] == length else storage[:, :, :length]
