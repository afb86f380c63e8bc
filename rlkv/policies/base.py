"""The compression-policy interface: a policy scores and selects, the cache owns everything else.

A `HeadMixedCache` (rlkv/cache/) keeps, per layer, the KV heads marked full with every token and
the other ("compressed") KV heads in a bounded store. Whenever a forward pass has added tokens to a
layer's compressed store, the cache attends with them, then asks the policy whether to compress
and which slots stay. The cache does the gathering into smaller tensors (memory really freed),
tracks logical positions, padding validity, the prompt protection and the sink/window overhead.

Writing a policy
----------------
    from dataclasses import dataclass
    from rlkv.policies import register_policy
    from rlkv.policies.base import CompressionPolicy, PolicyStore, keep_top_scores, top_scores_counts

    @register_policy("mine")
    @dataclass(eq=False, kw_only=True)
    class MyPolicy(CompressionPolicy):
        observe_queries = 8            # store.queries holds the last 8 queries of the compressed heads
        buffer: int = 128              # fields = the CompressionConfig.policy_kwargs it accepts

        def __post_init__(self):       # validate the fields here (a clear error naming the policy)
            ...

        def should_compress(self, store):            # called after every forward, per layer
            budget = store.budget_counts()           # Python ints: deciding never reads the device
            return budget is not None and any(
                n > b + self.buffer for n, b in zip(store.evictable_counts(), budget))

        def kept_counts(self, store):                # slots each row keeps per head, Python ints
            return top_scores_counts(store)

        def select(self, store):                     # -> BoolTensor keep [B, H_c, K] (or [B, K])
            scores = ...                             # FloatTensor [B, H_c, K], higher = keep
            return keep_top_scores(store, scores)

One policy instance serves a whole cache (all layers); keep per-layer state in `store.state` (a
dict the cache clears with each new sequence) or in `store.slot_buffer(...)`; keep cross-layer
state on `self` and clear it in `reset()`.

What the policy sees: a `PolicyStore` (one per layer; all tensors live on the model's device)
--------------------------------------------------------------------------------------------
The cache's `CompressedStore` (rlkv/cache/store.py) satisfies the `PolicyStore` protocol below;
policies depend on the protocol only, so nothing under rlkv/policies imports the cache.
- `layer_idx` int; `head_idx` LongTensor[H_c]: which KV heads of the layer are compressed;
  `num_groups` G: query heads per KV head (GQA), query head `h * G + g` uses KV head `h`.
- `keys`, `values`: [B, H_c, K, D], keys already rotated (RoPE) at their true position.
- `positions`: IntTensor[B, H_c, K] (int32; int64 past 2**31 tokens), the logical position of
  each slot = its column in the batch's (left-padded) token sequence, 0-based; -1 marks an empty
  slot (rows and heads may keep different counts, the store is padded to the largest). Valid slots
  of a (row, head) appear in increasing position order; empty slots can sit anywhere.
- `valid()` BoolTensor[B, H_c, K]: slot holds a real token (never padding).
- `protected()` BoolTensor[B, H_c, K]: prompt tokens when `protect_prompt` (always kept).
- `evictable()` = valid & not protected; `num_evictable()` LongTensor[B, H_c].
- `forced_keep()` BoolTensor[B, H_c, K]: protected | first `sink` tokens of the row | last
  `window` tokens of the row. The cache ORs this into every selection, so a policy never has to.
- `logical_length` int T (tokens seen, padding included); `prompt_length` int (columns of the
  prompt, padding included); `num_generated` int = T - prompt_length; `valid_length`
  LongTensor[B]: real tokens seen per row; `is_prefill` bool: this forward was (a chunk of) the prompt.
- `budget`: LongTensor[B] or None: how many evictable (non-protected) tokens may stay per
  (row, head), sink and window included. From `CompressionConfig.budget`: an int is used as is;
  a float ratio r gives `round(r * valid_length) + sink + window` (RLKV's dynamic budget);
  None falls back to the policy's `default_budget`; None there too = no budget.
- `sink`, `window` ints (from CompressionConfig).
- `queries` [B, H_c, G, N, D] (only if `observe_queries = N > 0`): the last N queries of the
  query heads of each compressed KV head (post-RoPE, as attention used them), oldest first;
  `query_positions` LongTensor[N]; `query_valid()` BoolTensor[B, N] (False for padding).
  N is smaller than requested until that many tokens were seen. Queries persist across steps.
- Tensors returned by the store are the cache's own: never modify them in place (build new ones),
  except `slot_buffer(...)` and `state`, which exist for that.
- Host counts (Python ints, one per batch row; every KV head of a row holds the same count):
  `slot_counts` (valid slots per (row, head)), `row_starts()`, `valid_lengths()`,
  `protected_counts()`, `evictable_counts()`, `forced_counts()`, `budget_counts()` (None: no
  budget). The cache keeps them without reading the device (once per prompt forward it reads
  where rows start), so a policy can decide and size a compression from them alone.
  `row_start_host` (list[int], or None where only the device knows: the static cache's view) and
  `all_valid` (bool: no slot is empty; False where unknown) let a policy skip masks it knows are
  all True (`rlkv.policies.helpers.scoring.real_queries`, `window_start`); `oldest_query_position` (int,
  or None where only the device knows) is the oldest remembered query's position;
  `forced_ends()` ((e, w) or None) says when the forced set is the first e and last w slots of
  every (row, head) (`select_top_scores`).
- `state` dict: per-layer scratch space for the policy, cleared at each new sequence.
- `slot_buffer(name, fill=0.0, dtype=torch.float32)` -> Tensor[B, H_c, K]: a per-slot value the
  cache keeps aligned with the slots (new slots get `fill`, evictions gather it). Update it in
  place (e.g. H2O's accumulated attention: `store.slot_buffer("acc").add_(...)`).

What a policy declares (class attributes) and the hooks it gets
----------------------------------------------------------------
- `observe_queries: int = 0` (above): a class attribute, or a property derived from a field
  (R-KV / SnapKV: their `window`; RPC: its `selector_window`).
- `observe_attention: bool = False`: in each forward, `on_attention(store, probs)` with
  probs FloatTensor[B, H_c, G, Q', K] = softmax attention of new queries over the store's slots
  (0 on empty/masked slots). The cache then computes the compressed heads' attention eagerly, in
  consecutive query chunks (Q' <= Q, bounded memory in a long prefill), one call per chunk.
- `observe_tokens: bool = False`: `on_tokens(token_ids LongTensor[B, Q], positions LongTensor[Q])`
  once per forward, before the layers run (from a forward pre-hook on the model; padding
  included, positions are logical).
- `observe_hidden_states: bool = False`: `on_hidden_states(hidden [B, Q, hidden], positions)`
  once per forward, with the last layer's output after the final norm (forward hook on the norm).
  It arrives after the layers ran, so a compression sees hidden states up to the previous step.
- `default_budget: int | float | None = None`: budget used when the config gives none.
- `reset()`: a new sequence (batch) starts; clear state kept on `self`.
- `state_tensors() -> list[Tensor]`: the tensors of that state, so that the cache's
  `resident_bytes()` counts them (tensors in `store.state` and slot buffers are counted already).
- `attach(model)`: called once by `rlkv.inference.make_cache` with the model the cache serves, for
  policies that act on the model itself (SkipKV's steering hook); install hooks idempotently.

When and what: the schedule is declared on the host
---------------------------------------------------
A decode step makes no host sync (docs/design.md): on a GPU, reading a tensor's value back
(`.item()`, `bool(t)`, `int(t)`, `nonzero`, `.tolist()`) makes the host wait for the device.
So a policy decides *when* and *how much* from Python ints only, and only *which* on the device.
- `should_compress(store) -> bool`: called after every forward (prefill and each decode step) for
  each layer with compressed heads. It must return a Python bool computed from host values: the
  store's host counts (above), `logical_length`, `prompt_length`, `num_generated`, `is_prefill`,
  the policy's own fields and host state (RPC: `num_generated` against its interval; R-KV:
  `evictable_counts()` against `budget_counts()` + buffer), never from a tensor.
  Default: compress when some row holds more evictable tokens than its budget.
- `kept_counts(store) -> list[int] | None`: called when `should_compress` said yes, before
  `select`: how many slots each row keeps per KV head after the compression, `(keep |
  forced_keep()) & valid()` counted. The store gathers exactly that many (no read of the mask);
  declaring fewer than `select` keeps drops kept tokens, more leaves empty slots. Default None:
  the store counts the mask itself (one host read per compression, correct for any policy).
  `top_scores_counts(store, budget=None)` is the count of `keep_top_scores`; `forced_counts()`
  that of `keep_forced_only`.
- `selects_by_position: bool = False` (class attribute): `select` depends only on the slots'
  positions and per-row values (sink + window, sink + most recent): rows and heads that hold the
  same positions keep the same slots, so the store copies whole columns.
- `select(store) -> BoolTensor`: which slots stay. `[B, H_c, K]` per (row, KV head), or `[B, K]`
  per layer (applied to every head: only valid if the policy always selects per layer, so the
  slots of all heads of a layer hold the same positions). The cache keeps
  `(keep | forced_keep()) & valid()` and reallocates the store to exactly the largest kept count.
  Or a LongTensor `[B, H_c, n]`: the kept slots themselves, ascending in every (row, head), forced
  set included (what `select_top_scores` returns when the host knows them to be n per (row, head));
  the store copies them, no mask built or read.
  Helpers: `keep_top_scores(store, scores, budget=None)`, `select_top_scores(store, scores,
  budget=None)` (the same slots, as indices where it can), `keep_forced_only(store)`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Protocol

import torch


class PolicyStore(Protocol):
    """What a policy may read and call on one layer's compressed heads (see the module docstring)."""

    layer_idx: int
    head_idx: torch.Tensor
    num_groups: int
    sink: int
    window: int
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    queries: torch.Tensor | None
    query_positions: torch.Tensor | None
    row_start: torch.Tensor
    logical_length: int
    prompt_length: int
    is_prefill: bool
    state: dict[str, Any]

    slot_counts: list[int]
    row_start_host: list[int] | None
    all_valid: bool

    @property
    def num_generated(self) -> int: ...
    @property
    def valid_length(self) -> torch.Tensor: ...
    @property
    def budget(self) -> torch.Tensor | None: ...
    def valid(self) -> torch.Tensor: ...
    def protected(self) -> torch.Tensor: ...
    def evictable(self) -> torch.Tensor: ...
    def num_evictable(self) -> torch.Tensor: ...
    def forced_keep(self) -> torch.Tensor: ...
    def query_valid(self) -> torch.Tensor: ...
    def row_starts(self) -> list[int]: ...
    def valid_lengths(self) -> list[int]: ...
    def protected_counts(self) -> list[int]: ...
    def evictable_counts(self) -> list[int]: ...
    def forced_counts(self) -> list[int]: ...
    def forced_ends(self) -> tuple[int, int] | None: ...
    def budget_counts(self) -> list[int] | None: ...
    def slot_buffer(
        self, name: str, fill: float = 0.0, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor: ...


class CompressionPolicy:
    """Base class of token-eviction policies for the compressed heads of a `HeadMixedCache`."""

    name: ClassVar[str] = ""
    observe_queries: ClassVar[int] = 0
    observe_attention: ClassVar[bool] = False
    observe_tokens: ClassVar[bool] = False
    observe_hidden_states: ClassVar[bool] = False
    default_budget: ClassVar[int | float | None] = None
    selects_by_position: ClassVar[bool] = False

    def reset(self) -> None:
        """A new sequence starts: clear any state kept on the policy object."""

    def state_tensors(self) -> list[torch.Tensor]:
        """Per-sequence tensors kept on the policy object (counted in the cache's `resident_bytes`)."""
        return []

    def reserve(self, generated: int) -> None:
        """At most `generated` tokens follow this request's prompt: size per-token state once (the static
        cache calls it before the prefill, so no decode step grows a tensor or reads the device)."""

    def attach(self, model: torch.nn.Module) -> None:
        """The model this policy's cache serves (from `make_cache`): install model hooks here, idempotently."""

    def on_tokens(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Token ids [B, Q] entering the model at logical `positions` [Q] (if `observe_tokens`)."""

    def on_hidden_states(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> None:
        """Final-norm hidden states [B, Q, hidden] at logical `positions` [Q] (if `observe_hidden_states`)."""

    def on_attention(self, store: PolicyStore, probs: torch.Tensor) -> None:
        """Attention probabilities [B, H_c, G, Q', K] of a chunk of the new queries over the store
        (if `observe_attention`)."""

    def should_compress(self, store: PolicyStore) -> bool:
        """Whether to run `select` now, from host values only (a Python bool, never read from a tensor);
        default: some row holds more evictable tokens than its budget."""
        budget = store.budget_counts()
        if budget is None:
            return False
        return any(n > b for n, b in zip(store.evictable_counts(), budget, strict=True))

    def kept_counts(self, store: PolicyStore) -> list[int] | None:
        """Slots each row keeps per KV head after this compression (Python ints), or None: the store
        counts the keep mask itself (one host read)."""
        return None

    def select(self, store: PolicyStore) -> torch.Tensor:
        """BoolTensor keep mask [B, H_c, K] (or [B, K] per layer) over the store's slots."""
        raise NotImplementedError(f"{type(self).__name__} must implement select(store)")


def select_top_scores(
    store: PolicyStore, scores: torch.Tensor, budget: torch.Tensor | int | None = None, newest: int = 0
) -> torch.Tensor:
    """What `keep_top_scores` keeps, as a valid `select` result: the kept slots LongTensor[B, H_c, n]
    (ascending in every (row, head)) when the host knows the forced set is the first and last slots of
    every (row, head) (`forced_ends`) and one count `extra` beyond it, else the keep mask.

    The slots between the forced ends are ranked by one stable sort (ties towards the older position,
    as in `keep_top_scores`), so no forced mask, rank or keep mask is built. `newest`: the last
    `newest` slots of every (row, head) score +inf whatever `scores` says (a policy's observation
    window, when it is the newest slots): they join the late forced range when the budget holds them.
    """
    extra = _host_extra(store, budget)
    ends = store.forced_ends() if extra is not None else None
    batch, heads, slots = store.keys.shape[:3]
    if ends is not None and newest:
        early, late = ends
        # the window slots past the forced ones rank first and spend `extra`; if it cannot hold them
        # all, the stable sort below decides which (the older ones)
        wider = max(late, newest)
        if early + wider <= slots and extra >= wider - late:
            ends, extra, newest = (early, wider), extra - (wider - late), 0
    if newest:
        scores = torch.cat(
            [scores[..., : slots - newest], scores.new_full((*scores.shape[:-1], newest), math.inf)], -1
        )
    if ends is None:
        return keep_top_scores(store, scores, budget)
    early, late = ends
    if scores.dim() == 2:
        scores = scores[:, None, :].expand(batch, heads, slots)
    # a decode step's compaction is a few small ops per layer: each skipped dispatch shows on CPU
    middle = scores[..., early : slots - late] if early or late else scores
    middle = middle.float().nan_to_num(nan=-_FLOAT_MAX, posinf=_FLOAT_MAX, neginf=-_FLOAT_MAX)
    top = torch.sort(middle, dim=-1, descending=True, stable=True).indices[..., :extra]
    chosen = torch.sort(top, dim=-1).values
    kept = [chosen.add_(early) if early else chosen]
    device, shape = top.device, (batch, heads)
    if early:
        kept.insert(0, torch.arange(early, device=device).expand(*shape, early))
    if late:
        kept.append(torch.arange(slots - late, slots, device=device).expand(*shape, late))
    return kept[0] if len(kept) == 1 else torch.cat(kept, dim=-1)


def keep_forced_only(store: PolicyStore) -> torch.Tensor:
    """Keep nothing beyond the cache's forced set (protected prompt, sink, window): BoolTensor [B, H_c, K]."""
    return store.forced_keep()


_FLOAT_MAX = torch.finfo(torch.float32).max


def top_scores_counts(store: PolicyStore, budget: list[int] | None = None) -> list[int]:
    """Slots per (row, head), per row, that `keep_top_scores(store, scores, budget)` keeps (forced set
    included), from host counts: forced + min(budget - forced evictable, other evictable slots).

    budget: evictable tokens per row (Python ints), or None for `store.budget_counts()`.
    """
    if budget is None:
        budget = store.budget_counts()
    if budget is None:
        raise ValueError(
            "top_scores_counts needs a budget: set CompressionConfig.budget or the policy's default_budget"
        )
    kept = []
    for count, forced, protected, row_budget in zip(
        store.slot_counts, store.forced_counts(), store.protected_counts(), budget, strict=True
    ):
        forced_evictable = forced - protected  # the protected prompt lies inside the forced set
        kept.append(forced + min(max(row_budget - forced_evictable, 0), count - forced))
    return kept


def _host_extra(store: PolicyStore, budget: torch.Tensor | int | None) -> int | None:
    """The evictable slots beyond the forced set that `keep_top_scores` keeps in every (row, head), when
    the host knows it is one count and the store has no empty slot (else None)."""
    if not store.all_valid or isinstance(budget, torch.Tensor):
        return None
    if budget is None and store.budget_counts() is None:
        return None  # keep_top_scores' error
    rows = None if budget is None else [int(budget)] * len(store.slot_counts)
    kept = top_scores_counts(store, rows)
    extra = {k - f for k, f in zip(kept, store.forced_counts(), strict=True)}
    return extra.pop() if len(extra) == 1 else None


def keep_top_scores(
    store: PolicyStore, scores: torch.Tensor, budget: torch.Tensor | int | None = None
) -> torch.Tensor:
    """Keep mask [B, H_c, K]: the forced set plus the highest-`scores` evictable slots.

    scores: FloatTensor [B, H_c, K] (or [B, K], shared by all heads); higher = more important.
    budget: evictable tokens to keep per (row, head), forced sink/window included; LongTensor[B],
    int, or None for `store.budget`. Ties break towards the older position.
    """
    forced = store.forced_keep()
    if scores.dim() == 2:
        scores = scores[:, None, :].expand_as(forced)
    finite = scores.float().nan_to_num(nan=-_FLOAT_MAX, posinf=_FLOAT_MAX, neginf=-_FLOAT_MAX)
    extra = _host_extra(store, budget)
    if extra is not None:
        # no empty slot, every (row, head) keeps `extra` candidates: the candidates are the slots not
        # forced (the protected prompt lies inside the forced set), no count or rank tensor to build
        ranked = finite.masked_fill(forced, float("-inf"))
        top = torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :extra]
        return forced | torch.zeros_like(forced).scatter_(-1, top, True)
    evictable = store.evictable()
    if budget is None:
        budget = store.budget
    if budget is None:
        raise ValueError(
            "keep_top_scores needs a budget: set CompressionConfig.budget or the policy's default_budget"
        )
    budget = torch.as_tensor(budget, device=forced.device).reshape(-1)
    budget = budget.expand(forced.shape[0]) if budget.numel() == 1 else budget
    already = (forced & evictable).sum(-1)  # forced evictable tokens spend budget too
    extra = (budget[:, None] - already).clamp(min=0)  # [B, H_c]
    candidate = evictable & ~forced
    # every candidate ranks above every other slot (an infinite or NaN score included), so the kept
    # count is exactly `top_scores_counts`
    ranked = finite.masked_fill(~candidate, float("-inf"))
    # stable sort on the slot order keeps older positions first among equal scores
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    return forced | (candidate & (rank < extra[..., None]))
