"""The "chain" task: a synthetic chain of thought whose later steps need facts from far back.

The prompt binds each of the 26 letters to a digit (`7 k=`) and to a successor letter (`m k>`),
one cycle through all 26 letters, bindings listed in random order, then names a start letter and
a number of steps N. The solution walks the chain from the start, one numbered step per letter,
each looking the current letter's digit and successor up among the bindings (far back in the
prompt), and answers the digit of the N-th letter:

    prompt:   chain : from start follow > for the given steps , answer the = value of the last .
              7 k= m k> ; 2 q= c q> ; ... ; start k ; steps 17 .
    solution: step 1 : k= 7 , k> m ; step 2 : m= 4 , m> q ; ... step 17 : c= 5 , c> z ; \\boxed{5}

Each lookup is a one-token associative recall (in the prompt, `k=` comes right after k's digit, so
a head matching the token `k=` can read the digit stored there). There is no arithmetic beyond
counting steps (a running sum mod 10 was tried first: a 4-layer model learns modular addition far
more slowly than retrieval). What is hard is the retrieval, which attention heads with a full KV
cache can do and sink + local windows cannot, as soon as the sequence is longer than the window
(prompt + solution are >= 300 words, one token each with the demo model's word-level tokenizer);
the step count N is also only in the prompt.

Splits are disjoint by construction: a problem belongs to the split chosen by a hash of its text,
and each split draws only problems from its own hash buckets.
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass

from rlkv.data.verify import extract_boxed, strip_thinking

SOURCE = "chain"
LETTERS = tuple(string.ascii_lowercase)
DIGITS = tuple(str(d) for d in range(10))
HEADER = "chain : from start follow > for the given steps , answer the = value of the last ."
# Steps per problem: >= 17 keeps every problem (prompt + solution) >= 300 words.
MIN_STEPS = 17
MAX_STEPS = 22
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


def make_problem(
    rng: random.Random,
    min_steps: int = MIN_STEPS,
    max_steps: int = MAX_STEPS,
    num_letters: int = len(LETTERS),
) -> ChainProblem:
    """Draw one problem from `rng` with a chain of `min_steps..max_steps` letters (any split).

    `num_letters` < 26 binds only a random subset of the letters (shorter problems, for a training
    curriculum); the task's own problems (`chain_problems`, `load_chain_task`) always bind all 26.
    """
    if not 2 <= num_letters <= len(LETTERS):
        raise ValueError(f"num_letters={num_letters}: must be in 2..26")
    if not 1 <= min_steps <= max_steps <= num_letters:
        raise ValueError(
            f"need 1 <= min_steps <= max_steps <= num_letters={num_letters}, "
            f"got min_steps={min_steps}, max_steps={max_steps}"
        )
    cycle = rng.sample(LETTERS, num_letters)
    successor = {cycle[i]: cycle[(i + 1) % len(cycle)] for i in range(len(cycle))}
    value = {letter: rng.randrange(10) for letter in cycle}
    listed = rng.sample(cycle, num_letters)
    num_steps = rng.randint(min_steps, max_steps)
    start = rng.choice(cycle)

    path = [start]
    while len(path) < num_steps:
        path.append(successor[path[-1]])
    bindings = " ; ".join(f"{value[v]} {v}= {successor[v]} {v}>" for v in listed)
    problem = f"{HEADER} {bindings} ; start {start} ; steps {num_steps} ."
    steps = [f"step {i} : {v}= {value[v]} , {v}> {successor[v]} ;" for i, v in enumerate(path, start=1)]
    answer = str(value[path[-1]])
    solution = " ".join(steps) + f" \\boxed{{{answer}}}"
    return ChainProblem(problem=problem, solution=solution, answer=answer)


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
        candidate = make_problem(rng)
        if split_of(candidate.problem) == split and candidate.problem not in seen:
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
