"""Sentence segmentation of generated text (SkipKV's sentences and its steering vectors share it).

The rule: a sentence ends after a run of delimiter tokens (`DELIMITERS`, consecutive delimiters
merged into one sentence end), so a non-delimiter token that follows a delimiter opens a new
sentence (`sentence_starts`). A token is a delimiter when its decoded text is one
(`is_delimiter_text`); `delimiter_token_mask` tabulates that over a tokenizer's vocabulary.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

DELIMITERS = ("\n", ".\n", ")\n", "\n\n", ".\n\n", ")\n\n")
NON_EXECUTION_KEYWORDS = ("Wait", "Alternatively", "again")
_DELIMITER_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def is_delimiter_text(text: str, delimiters: frozenset[str]) -> bool:
    """Whether a token's text ends a sentence: one of `delimiters` after dropping leading spaces/tabs
    (" \\n" is a newline too), or a run of newlines only ("\\n\\n\\n": consecutive delimiters in one token).
    Newline-plus-indentation tokens ("\\n    ") and ":\\n" do not end a sentence (code stays whole)."""
    return text.lstrip(" \t") in delimiters or (text != "" and text.strip("\n") == "")


def delimiter_token_mask(tokenizer: Any, delimiters: Sequence[str] = DELIMITERS) -> torch.Tensor:
    """BoolTensor [len(tokenizer)]: token ids whose decoded text ends a sentence (`is_delimiter_text`).

    Decoding a 150k vocabulary takes seconds, so the mask is remembered per tokenizer object.
    """
    wanted = frozenset(delimiters)
    try:
        known = _DELIMITER_MASKS.setdefault(tokenizer, {})
    except TypeError:  # a tokenizer that cannot be weakly referenced: no memo
        known = {}
    if wanted not in known:
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        known[wanted] = torch.tensor([is_delimiter_text(text, wanted) for text in texts], dtype=torch.bool)
    return known[wanted]


def delimiter_flags(token_ids: torch.Tensor, is_delimiter: torch.Tensor) -> torch.Tensor:
    """BoolTensor shaped like `token_ids`: which tokens are delimiters (ids beyond the mask are not)."""
    lookup = is_delimiter.to(token_ids.device)
    known = token_ids < lookup.numel()
    return lookup[token_ids.clamp(max=lookup.numel() - 1)] & known


def sentence_starts(is_delim: torch.Tensor, after_delimiter: torch.Tensor) -> torch.Tensor:
    """BoolTensor [B, Q]: tokens that open a new sentence (a non-delimiter right after a delimiter).

    is_delim: BoolTensor [B, Q] of consecutive tokens; after_delimiter: BoolTensor [B], whether the
    token before the first one was a delimiter.
    """
    previous = torch.cat([after_delimiter[:, None], is_delim[:, :-1]], dim=1)
    return previous & ~is_delim


def sentence_spans(token_ids: Sequence[int], is_delimiter: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) spans of the sentences of `token_ids` under `sentence_starts`' rule."""
    if not token_ids:
        return []
    ids = torch.tensor([list(token_ids)], dtype=torch.long)
    starts = sentence_starts(delimiter_flags(ids, is_delimiter), torch.zeros(1, dtype=torch.bool))[0]
    bounds = [0, *torch.nonzero(starts).flatten().tolist(), len(token_ids)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
