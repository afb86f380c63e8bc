"""SkipKV (seed 002): sentence-level eviction on top of R-KV's token score, optional adaptive steering.

The generated text is split into sentences at newline delimiter tokens (`DELIMITERS`, consecutive
delimiters merged into one sentence end). A sentence's embedding is the mean final-norm hidden
state of its tokens. When an earlier finished sentence i has cosine similarity
`lambda_ij > tau` with a later finished sentence j, sentence i is redundant and every one of its
cached tokens gets `-max_j lambda_ij` added to its R-KV score, so whole redundant sentences go
before any token-level eviction (R-KV's scores are ~0.1, the penalty ~1). Everything else, budget,
buffer and observation window included, is R-KV (`rlkv.policies.rkv`).

Sentence ranges. Sentences live in generation space: a sentence id for every generated position.
The cache carries each slot's logical position through every eviction, so the cache-space range of
a sentence in a (row, head) is the first and last slot holding one of its surviving tokens
(`sentence_cache_ranges`), SkipKV's eq. (9)-(11) without incremental bookkeeping that could drift.

The policy needs the tokenizer to recognise delimiter tokens: pass it (or its path) as
`CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": tok})`.
Adaptive steering: `policy_kwargs={"steering": "vector.json"}` (see `rlkv.policies.helpers.steering`).
Batch grouping by prompt length: `rlkv.inference.generate(..., group_by_length=True)`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlkv.policies import register_policy
from rlkv.policies.base import PolicyStore
from rlkv.policies.helpers.sentences import (
    DELIMITERS,
    NON_EXECUTION_KEYWORDS,
    delimiter_flags,
    delimiter_token_mask,
    sentence_starts,
)
from rlkv.policies.helpers.steering import SteeringVector, install_steering
from rlkv.policies.rkv import RKVPolicy


def _grow(tensor: torch.Tensor, dim: int, size: int, fill: float | int) -> torch.Tensor:
    """`tensor` padded with `fill` along `dim` to at least `size` (capacity doubles to amortise copies)."""
    if tensor.shape[dim] >= size:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = max(size, 2 * tensor.shape[dim]) - tensor.shape[dim]
    return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=dim)


@register_policy("skipkv")
@dataclass(eq=False, kw_only=True)
class SkipKVPolicy(RKVPolicy):
    """R-KV scores minus a sentence redundancy penalty; optional adaptive steering at delimiters.

    tokenizer: the model's tokenizer, or a path / hub id loadable by `AutoTokenizer` (required).
    tau: sentence cosine similarity above which the earlier sentence is redundant (0.95).
    delimiters: token texts that end a sentence (`DELIMITERS`).
    steering: path of a steering-vector file (`rlkv steering compute`) or None.
    steering_alpha0, steering_gamma: `alpha_t = alpha0 + gamma * N_nonexec` (1.0, 0.02).
    keywords: non-execution keywords counted for `N_nonexec` (`NON_EXECUTION_KEYWORDS`).
    Other arguments: as `rkv` (window 8, kernel 7, lam 0.1, threshold 0.5, buffer 128, ...).

    State per sequence (reset by the cache): `sentence_of` LongTensor [B, T_gen] (sentence id of
    every generated position), `open_sentence` [B] (id of the unfinished sentence), running sums
    of hidden states per sentence, `non_execution` [B] (finished sentences with a keyword).
    """

    observe_tokens = True
    observe_hidden_states = True

    tokenizer: Any = field(default=None, repr=False)
    tau: float = 0.95
    delimiters: Sequence[str] = DELIMITERS
    steering: str | os.PathLike | SteeringVector | None = None
    steering_alpha0: float = 1.0
    steering_gamma: float = 0.02
    keywords: Sequence[str] = NON_EXECUTION_KEYWORDS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tokenizer is None:
            raise ValueError(
                "skipkv needs the tokenizer to find sentence delimiters: "
                'CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": tokenizer_or_its_path})'
            )
        if isinstance(self.tokenizer, (str, os.PathLike)):
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer)
        if not 0.0 < self.tau <= 1.0:
            raise ValueError(
                f"skipkv: tau={self.tau} must be in (0, 1] (sentence cosine similarity threshold)"
            )
        if not self.delimiters:
            raise ValueError("skipkv: delimiters must name at least one token text, e.g. '\\n'")
        self.tau = float(self.tau)
        self.is_delimiter = delimiter_token_mask(self.tokenizer, self.delimiters)
        if not bool(self.is_delimiter.any()):
            raise ValueError(
                f"skipkv: no token of the tokenizer decodes to one of the delimiters {list(self.delimiters)}"
            )
        if self.steering is not None and not hasattr(self.steering, "vector"):
            self.steering = SteeringVector.load(self.steering)
        self.steering_alpha0 = float(self.steering_alpha0)
        self.steering_gamma = float(self.steering_gamma)
        self.keywords = tuple(self.keywords)
        self.reset()

    # per-sequence state ----------------------------------------------------------------------
    def reset(self) -> None:
        self.reserved = 0  # generated tokens the state is sized for at once (`reserve`; 0: it grows)
        self.prompt_length: int | None = None
        self.sentence_of: torch.Tensor | None = None  # LongTensor [B, capacity]
        self.token_ids: torch.Tensor | None = None  # LongTensor [B, capacity] (generated tokens)
        self.num_generated = 0
        self.seen = 0  # logical columns fed so far (host): positions are never read back
        self.hidden_updates = 0  # on_hidden_states calls so far: the penalty's cache key
        # host bound on the sentence ids: the largest id read (+1) and the tokens fed since that read
        # (each token starts at most one sentence), so growing the sums rarely reads the device
        self.sentence_bound = (0, 0)
        self.open_sentence: torch.Tensor | None = None  # LongTensor [B]
        self.after_delimiter: torch.Tensor | None = None  # BoolTensor [B]: last token was a delimiter
        self.sentence_sum: torch.Tensor | None = None  # FloatTensor [B, S_capacity, hidden]
        self.sentence_count: torch.Tensor | None = None  # FloatTensor [B, S_capacity]
        self.non_execution: torch.Tensor | None = None  # LongTensor [B]
        self.input_is_delimiter: torch.Tensor | None = None  # BoolTensor [B, Q] of the running forward
        self._penalty_key: tuple[int, int] | None = None
        self._penalty: torch.Tensor | None = None

    def state_tensors(self) -> list[torch.Tensor]:
        """The sentence bookkeeping: ids and token ids per generated token, sums per sentence, row flags."""
        state = [
            self.sentence_of,
            self.token_ids,
            self.open_sentence,
            self.after_delimiter,
            self.sentence_sum,
            self.sentence_count,
            self.non_execution,
            self.input_is_delimiter,
            self._penalty,
        ]
        return [t for t in state if t is not None]

    def reserve(self, generated: int) -> None:
        """Size the sentence bookkeeping for `generated` tokens (sentence ids up to `generated`), so no
        step grows it and `_fit_sentences` never reads an id back."""
        self.reserved = int(generated)

    def attach(self, model: torch.nn.Module) -> None:
        """Install the steering hook on the model (only when a steering vector was given)."""
        if self.steering is not None:
            install_steering(model, self.steering)

    def on_tokens(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        batch, q_len = token_ids.shape
        device = token_ids.device
        first, self.seen = self.seen, self.seen + q_len  # positions are first .. first + q_len - 1
        # the prompt = every token before the first single-token step (chunked prefill too), as the cache counts it
        prompt_chunk = self.num_generated == 0 and q_len > 1 and first == self.prompt_length
        if self.prompt_length is None or prompt_chunk:
            self.prompt_length = self.seen
            if self.sentence_of is None:
                self.sentence_of = torch.full((batch, self.reserved), -1, dtype=torch.long, device=device)
                self.token_ids = torch.zeros(batch, self.reserved, dtype=torch.long, device=device)
                self.open_sentence = torch.zeros(batch, dtype=torch.long, device=device)
                self.after_delimiter = torch.zeros(batch, dtype=torch.bool, device=device)
                self.non_execution = torch.zeros(batch, dtype=torch.long, device=device)
            self.input_is_delimiter = torch.zeros(batch, q_len, dtype=torch.bool, device=device)
            return
        is_delim = delimiter_flags(token_ids, self.is_delimiter)  # [B, Q]
        starts = sentence_starts(is_delim, self.after_delimiter)
        ids = self.open_sentence[:, None] + starts.long().cumsum(dim=1)
        closed_before = self.open_sentence.clone()
        start, stop = self.num_generated, self.num_generated + q_len
        self.sentence_of = _grow(self.sentence_of, 1, stop, -1)
        self.token_ids = _grow(self.token_ids, 1, stop, 0)
        self.sentence_of[:, start:stop] = ids
        self.token_ids[:, start:stop] = token_ids
        self.num_generated = stop
        self.open_sentence = ids[:, -1]
        self.after_delimiter = is_delim[:, -1]
        self.input_is_delimiter = is_delim
        if self.steering is not None:
            self._count_non_execution(closed_before)

    def _count_non_execution(self, first_new: torch.Tensor) -> None:
        """Add the finished sentences (ids first_new[b] .. open_sentence[b] - 1) that hold a keyword."""
        for row in torch.nonzero(self.open_sentence > first_new).flatten().tolist():
            ids = self.sentence_of[row, : self.num_generated]
            for sentence in range(int(first_new[row]), int(self.open_sentence[row])):
                text = self.tokenizer.decode(
                    self.token_ids[row, : self.num_generated][ids == sentence].tolist()
                )
                self.non_execution[row] += int(any(k in text for k in self.keywords))

    def on_hidden_states(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> None:
        if self.prompt_length is None:
            return
        # this forward's columns are seen - Q .. seen - 1 (host): the generated ones are a suffix
        q_len = hidden_states.shape[1]
        skip = max(0, self.prompt_length - (self.seen - q_len))
        if skip >= q_len:
            return
        self.hidden_updates += 1
        hidden = hidden_states[:, skip:].detach().float()  # [B, Q', hidden]
        begin = self.seen - q_len + skip - self.prompt_length
        ids = self.sentence_of[:, begin : self.seen - self.prompt_length]  # [B, Q']
        if self.sentence_sum is None:
            sentences = self.reserved + 1 if self.reserved else 0  # ids 0 .. generated tokens
            self.sentence_sum = hidden.new_zeros(hidden.shape[0], sentences, hidden.shape[-1])
            self.sentence_count = hidden.new_zeros(hidden.shape[0], sentences)
        self._fit_sentences(ids)
        self.sentence_sum.scatter_add_(1, ids[..., None].expand_as(hidden), hidden)
        self.sentence_count.scatter_add_(1, ids, torch.ones_like(ids, dtype=hidden.dtype))

    def _fit_sentences(self, ids: torch.Tensor) -> None:
        """Grow the per-sentence sums to hold the sentence ids `ids` [B, Q'], reading their maximum
        only when the host bound (largest id read + tokens fed since) exceeds the capacity; the sums
        then get twice the ids read, so reads come every `capacity - read` tokens at the least."""
        read, since = self.sentence_bound
        since += ids.shape[1]
        capacity = self.sentence_sum.shape[1]
        if read + since > capacity:
            read, since = int(ids.max()) + 1, 0  # the bounded read (see tests/test_host_syncs.py)
            size = max(capacity, 2 * read, read + 64)
            self.sentence_sum = _grow(self.sentence_sum, 1, size, 0.0)
            self.sentence_count = _grow(self.sentence_count, 1, size, 0.0)
        self.sentence_bound = (read, since)

    # scoring -----------------------------------------------------------------------------
    def sentence_penalty(self) -> torch.Tensor:
        """FloatTensor [B, S]: `max_j lambda_ij` over later finished sentences j with lambda_ij > tau, else 0.

        lambda_ij is the cosine similarity of the mean hidden states of finished sentences i < j.
        """
        if self.sentence_sum is None:
            batch = 0 if self.open_sentence is None else self.open_sentence.shape[0]
            return torch.zeros(batch, 0)
        key = (self.num_generated, self.hidden_updates)
        if self._penalty_key == key:
            return self._penalty
        # ids go up to the tokens generated (host-known), whatever capacity the sums were given
        num = min(self.sentence_count.shape[1], self.num_generated + 1)
        count = self.sentence_count[:, :num]
        finished = (torch.arange(num, device=count.device) < self.open_sentence[:, None]) & (count > 0)
        mean = self.sentence_sum[:, :num] / count.clamp(min=1.0)[..., None]
        unit = mean / (torch.linalg.vector_norm(mean, dim=-1, keepdim=True) + 1e-8)
        sim = unit @ unit.transpose(1, 2)  # [B, S, S]
        later = torch.ones(num, num, dtype=torch.bool, device=count.device).triu(diagonal=1)
        pair = finished[:, :, None] & finished[:, None, :] & later & (sim > self.tau)
        self._penalty = torch.where(pair, sim, torch.zeros_like(sim)).amax(dim=2)
        self._penalty_key = key
        return self._penalty

    def slot_sentences(self, store: PolicyStore) -> torch.Tensor:
        """LongTensor [B, H_c, K]: sentence id of each slot's token, -1 for prompt and empty slots."""
        gen = store.positions - self.prompt_length
        inside = store.valid() & (gen >= 0) & (gen < self.num_generated)
        batch, heads, slots = gen.shape
        table = self.sentence_of[:, None, :].expand(batch, heads, -1)
        ids = table.gather(2, gen.clamp(min=0, max=max(self.num_generated - 1, 0)).long())
        return torch.where(inside, ids, -1)

    def sentence_cache_ranges(self, store: PolicyStore) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache-space ranges (begin, end) LongTensor [B, H_c, S] of every sentence (inclusive slot indices).

        begin/end are the first/last slot holding a surviving token of the sentence in that
        (row, head); -1 when none survives. S = sentences started so far (the open one included).
        """
        ids = self.slot_sentences(store)
        num = int(self.open_sentence.max()) + 1
        batch, heads, slots = ids.shape
        slot_index = torch.arange(slots, device=ids.device).expand_as(ids)
        target = torch.where(ids >= 0, ids, num)  # invalid slots go to a spill column
        begin = torch.full((batch, heads, num + 1), slots, dtype=torch.long, device=ids.device)
        end = torch.full((batch, heads, num + 1), -1, dtype=torch.long, device=ids.device)
        begin.scatter_reduce_(2, target, slot_index, reduce="amin")
        end.scatter_reduce_(2, target, slot_index, reduce="amax")
        begin, end = begin[..., :num], end[..., :num]
        return torch.where(end >= 0, begin, -1), end

    def scores(self, store: PolicyStore) -> torch.Tensor:
        """R-KV score minus the redundancy penalty of each slot's sentence: FloatTensor [B, H_c, K]."""
        scores = super().scores(store)
        if self.prompt_length is None or self.num_generated == 0:
            return scores
        penalty = self.sentence_penalty().to(scores.device)
        if penalty.shape[1] == 0:
            return scores
        ids = self.slot_sentences(store)
        batch, heads, _ = ids.shape
        per_slot = penalty[:, None, :].expand(batch, heads, -1).gather(2, ids.clamp(0, penalty.shape[1] - 1))
        known = (ids >= 0) & (ids < penalty.shape[1])
        return scores - torch.where(known, per_slot, torch.zeros_like(per_slot))

    # steering ----------------------------------------------------------------------------
    def steering_strength(self) -> torch.Tensor:
        """alpha_t per row: FloatTensor [B] = alpha0 + gamma * (finished non-execution sentences)."""
        return self.steering_alpha0 + self.steering_gamma * self.non_execution.float()

    def steering_delta(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """What to add to the steered layer's output [B, Q, hidden]: alpha_t * v at generated delimiter inputs."""
        if self.steering is None or self.input_is_delimiter is None or self.num_generated == 0:
            return None
        at = self.input_is_delimiter
        if at.shape != hidden.shape[:2]:
            return None
        # added everywhere (0 off the delimiters): testing for a delimiter would read the device
        vector = self.steering.vector.to(hidden.device, hidden.dtype)
        scale = (self.steering_strength()[:, None] * at.float()).to(hidden.dtype)
        return scale[..., None] * vector
