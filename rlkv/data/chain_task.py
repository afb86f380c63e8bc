"""The "chain" task: a synthetic chain of thought whose every step needs a fact from far back.

The prompt is a document of filler words with 24 facts scattered through it, one word each: for
each of 12 letters (drawn from the alphabet) its digit (`k=7`) and its successor letter (`k>m`; the
successors form one cycle through the 12 letters). The question at the end names a start and an
end letter. The solution walks the cycle
from the start to the end, writing each letter's digit fact and successor fact as it goes, and
answers the end letter's digit:

    prompt:   chain : walk > from start to end , answer the = digit of end .
              the so k>m in 7 ... c=5 of ... q>c ... ; start k end c .
    solution: k k=7 k>m m=4 m>q q=1 q>c c=5 \\boxed{5}

Every fact word the solution writes (6-9 letters visited) is a copy of a word of the prompt's
document, found by its letter: a one-word associative recall over 300+ words, which an attention head with a full KV
cache can do and a sink + local window cannot (the facts lie anywhere in the document, mostly far
outside the last 64 words). Deciding where to stop needs the end letter, also only in the prompt.
A fact is one word so that one attention head can match it (a fact spread over several words needs
a two-layer induction circuit, which a tiny model trained from scratch on 2 CPU cores did not form).

Splits are disjoint by construction: a problem belongs to the split chosen by a hash of its text,
and each split draws only problems from its own hash buckets.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass

from rlkv.verifiers.answers import extract_boxed, strip_thinking
from rlkv.verifiers.verify import register_verifier

SOURCE = "chain"
LETTERS = tuple(string.ascii_lowercase)
DIGITS = tuple(str(d) for d in range(10))
HEADER = "chain : walk > from start to end , answer the = digit of end ."
FILLER = ("the", "of", "and", "is", "to", "in", "it", "so", "on", "at", "by", "as")
# Letters per problem (drawn from the alphabet), and letters visited: start and end included.
NUM_LETTERS = 12
MIN_STEPS = 6
MAX_STEPS = 9
# Words in the document: 2 * NUM_LETTERS facts + filler. Keeps every problem (prompt + solution) >= 300 words.
BODY_WORDS = 270
# Hash buckets (out of 10) each split draws from.
SPLIT_BUCKETS = {"train": frozenset(range(2, 10)), "validation": frozenset({1}), "test": frozenset({0})}


@dataclass(frozen=True)
class ChainProblem:
    """One problem: `problem` (prompt text), `solution` (reference chain of thought), `answer` (one digit)."""

    problem: str
    solution: str
    answer: str


def split_of(problem: str) -> str:
    """The split a problem text belongs to (by a stable hash of the text)."""
    bucket = int.from_bytes(hashlib.sha256(problem.encode()).digest()[:8], "little") % 10
    return next(name for name, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


def digit_fact(letter: str, digit: int | str) -> str:
    """The one-word fact "letter has digit": `k=7`."""
    return f"{letter}={digit}"


def successor_fact(letter: str, successor: str) -> str:
    """The one-word fact "letter's successor is": `k>m`."""
    return f"{letter}>{successor}"


def vocabulary() -> list[str]:
    """Every word a chain problem or solution can contain (for a word-level tokenizer)."""
    words = list(HEADER.split()) + list(FILLER) + [";", "start", "end"] + list(LETTERS)
    words += [digit_fact(v, d) for v in LETTERS for d in DIGITS]
    words += [successor_fact(v, w) for v in LETTERS for w in LETTERS if v != w]
    words += [f"\\boxed{{{d}}}" for d in DIGITS]
    return list(dict.fromkeys(words))


def make_problem(
    rng: random.Random,
    min_steps: int = MIN_STEPS,
    max_steps: int = MAX_STEPS,
    num_letters: int = NUM_LETTERS,
    body_words: int = BODY_WORDS,
) -> ChainProblem:
    """Draw one problem from `rng` visiting `min_steps..max_steps` letters (any split).

    The problem uses `num_letters` letters drawn from the alphabet; `body_words` < BODY_WORDS shortens the
    document (shorter problems, for a training curriculum). The task's own problems
    (`chain_problems`, `load_chain_task`) always use the defaults.
    """
    if not 2 <= num_letters <= len(LETTERS):
        raise ValueError(f"num_letters={num_letters}: must be in 2..26")
    if not 2 <= min_steps <= max_steps <= num_letters:
        raise ValueError(
            f"need 2 <= min_steps <= max_steps <= num_letters={num_letters}, "
            f"got min_steps={min_steps}, max_steps={max_steps}"
        )
    if body_words < 2 * num_letters:
        raise ValueError(f"body_words={body_words}: must be >= 2 * num_letters = {2 * num_letters}")
    cycle = rng.sample(LETTERS, num_letters)
    successor = {cycle[i]: cycle[(i + 1) % len(cycle)] for i in range(len(cycle))}
    value = {letter: rng.randrange(10) for letter in cycle}
    num_steps = rng.randint(min_steps, max_steps)
    start = rng.choice(cycle)

    path = [start]
    while len(path) < num_steps:
        path.append(successor[path[-1]])
    end = path[-1]
    facts = [digit_fact(v, value[v]) for v in cycle] + [successor_fact(v, successor[v]) for v in cycle]
    body = [rng.choice(FILLER) for _ in range(body_words - len(facts))]
    for fact in rng.sample(facts, len(facts)):
        body.insert(rng.randrange(len(body) + 1), fact)
    problem = f"{HEADER} {' '.join(body)} ; start {start} end {end} ."
    walk = [f"{digit_fact(v, value[v])} {successor_fact(v, successor[v])}" for v in path[:-1]]
    answer = str(value[end])
    solution = " ".join([start, *walk, digit_fact(end, answer), f"\\boxed{{{answer}}}"])
    return ChainProblem(problem=problem, solution=solution, answer=answer)


def draw_problem(rng: random.Random, split: str, **kwargs) -> ChainProblem:
    """The next problem `rng` draws that belongs to `split` (`kwargs` go to `make_problem`)."""
    while True:
        problem = make_problem(rng, **kwargs)
        if split_of(problem.problem) == split:
            return problem


def chain_problems(split: str = "train", num: int = 200, seed: int = 0) -> list[ChainProblem]:
    """`num` distinct problems of `split` ("train", "validation" or "test"), deterministic in `seed`."""
    if split not in SPLIT_BUCKETS:
        raise ValueError(f"split={split!r}: choose one of {sorted(SPLIT_BUCKETS)}")
    if num < 0:
        raise ValueError(f"num={num}: must be >= 0")
    rng = random.Random(f"rlkv-chain:{split}:{seed}")
    problems: list[ChainProblem] = []
    seen: set[str] = set()
    while len(problems) < num:
        candidate = draw_problem(rng, split)
        if candidate.problem not in seen:
            seen.add(candidate.problem)
            problems.append(candidate)
    return problems


def load_chain_task(split: str = "test", num: int = 200, seed: int = 0):
    """The chain task as a `datasets.Dataset` with columns problem, answer, source ("chain"), solution."""
    import datasets

    problems = chain_problems(split, num, seed)
    return datasets.Dataset.from_dict(
        {
            "problem": [p.problem for p in problems],
            "answer": [p.answer for p in problems],
            "source": [SOURCE] * len(problems),
            "solution": [p.solution for p in problems],
        }
    )


def verify_chain(completion: str, answer: str) -> bool:
    """True when the last `\\boxed{...}` of `completion` (after any `</think>`) equals `answer`."""
    boxed = extract_boxed(strip_thinking(completion))
    return boxed is not None and boxed == str(answer).strip()


def _verify_chain_example(completion: str, example: dict) -> bool:
    return bool(verify_chain(completion, example["answer"]))


register_verifier("chain", _verify_chain_example)
