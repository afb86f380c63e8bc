"""Error-mode classifier and repetition detector on constructed texts and token sequences."""

import random

import pytest
import torch

from rlkv.eval.error_modes import RepetitionRule, RepetitionStop, classify_error


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _varied_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(
        f"{rng.choice('abcdefghijklmnopqrstuvwxyz')}{rng.randrange(10**6)}" for _ in range(n_words)
    )


def test_looping_text_is_repetitive_whatever_the_finish(tokenizer):
    text = "let x be 3 then x + 4 = 7. " + "wait, let me compute again: 3 + 4 = 7. " * 40
    ids = _ids(tokenizer, text.rstrip())  # a trailing lone space would tokenize unlike the loop
    rule = RepetitionRule()
    assert rule.is_repetitive(ids)
    assert rule.loop_period(ids) is not None
    for finish in ("length", "eos"):
        assert classify_error(correct=False, finish_reason=finish, token_ids=ids) == "repetitive"


def test_correct_is_never_an_error(tokenizer):
    ids = _ids(tokenizer, "so we have " * 100)
    assert classify_error(correct=True, finish_reason="length", token_ids=ids) is None


def test_overlength_and_incorrect_on_varied_text(tokenizer):
    ids = _ids(tokenizer, _varied_text(300))
    assert len(ids) > 400 and not RepetitionRule().is_repetitive(ids)
    assert classify_error(correct=False, finish_reason="length", token_ids=ids) == "overlength"
    assert classify_error(correct=False, finish_reason="eos", token_ids=ids) == "incorrect"
    assert classify_error(correct=False, finish_reason="repetition", token_ids=ids) == "repetitive"


def test_reference_rule_low_diversity_without_exact_period():
    rng = random.Random(1)
    # 400 tokens drawn from 39 distinct ids in random order: no exact period, < 10% distinct
    near_loop = [rng.randrange(39) for _ in range(400)]
    rule = RepetitionRule()
    assert rule.loop_period(near_loop) is None
    assert rule.low_diversity(near_loop) and rule.is_repetitive(near_loop)
    diverse = [rng.randrange(41) + 1000 * (i % 2) for i in range(400)]  # >= 41 distinct
    assert len(set(diverse)) >= 40 and not rule.low_diversity(diverse)
    # the reference rule needs a full window of tokens
    assert not rule.low_diversity(near_loop[:399])


def test_exact_loop_needs_enough_tokens():
    rule = RepetitionRule(min_loop_tokens=64, min_repeats=4)
    prefix = list(range(100, 150))
    unit = [1, 2, 3, 4, 5, 6, 7]
    assert rule.loop_period(prefix + unit * 10) == 7  # 70 tokens of loop
    assert rule.loop_period(prefix + unit * 5) is None  # 35 tokens: a short echo, not a loop
    assert rule.loop_period(prefix + [9] * 64) == 1


def test_rule_rejects_bad_fields():
    with pytest.raises(ValueError, match="min_unique_ratio"):
        RepetitionRule(min_unique_ratio=0.0)
    with pytest.raises(ValueError, match="window"):
        RepetitionRule(window=0)


def test_repetition_stop_ends_only_looping_rows():
    rule = RepetitionRule(min_loop_tokens=16, min_repeats=4)
    stop = RepetitionStop(rule, every=4)
    prompt = torch.arange(10).repeat(2, 1)
    loop = torch.tensor([5, 6] * 20)
    varied = torch.arange(200, 240)
    seqs = torch.cat([prompt, torch.stack([loop, varied])], dim=1)
    flags = []
    for step in range(1, 41):
        flags.append(stop(seqs[:, : 10 + step], scores=None).tolist())
    assert flags[15] == [True, False]  # 16 generated tokens: the loop is 16 tokens long
    assert not any(f[0] for f in flags[:15])
    assert stop.stopped_rows == [True, False]
    assert stop.ended(0, 16) and not stop.ended(1, 40)
    # a new generate call (shorter sequence) starts fresh
    stop(seqs[:, :11], scores=None)
    assert stop.stopped_rows == [False, False]


def test_a_row_padded_after_it_finished_was_not_ended_by_repetition():
    """generate pads a finished row (a stop string after 12 tokens) until the batch is done; the
    detector flags the run of pads as a loop, but it did not end that row: the row's own 12 tokens
    are varied. A row that really loops was ended at the check where the loop showed."""
    rule = RepetitionRule(min_loop_tokens=16, min_repeats=4)
    stop = RepetitionStop(rule, every=4)
    pad = 0
    prompt = torch.arange(10, 20).repeat(2, 1)
    finished = torch.cat([torch.arange(100, 112), torch.full((28,), pad)])  # ended after 12 tokens
    looping = torch.tensor([5, 6] * 20)
    seqs = torch.cat([prompt, torch.stack([finished, looping])], dim=1)
    for step in range(1, 41):
        stop(seqs[:, : 10 + step], scores=None)
    assert stop.stopped_rows == [True, True]  # the pads look like a loop ...
    assert not stop.ended(0, 12)  # ... after the row's end: a stop-string finish, not repetition
    assert stop.ended(1, 16)  # the looping row stopped at the check that saw 16 looped tokens
