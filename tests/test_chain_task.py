"""The chain task (generator, splits, verifier) and the shipped demo model in assets/demo-model."""

import random
import re
from pathlib import Path

import pytest
import torch

from rlkv.data.chain_task import (
    BODY_WORDS,
    HEADER,
    LETTERS,
    MAX_STEPS,
    MIN_STEPS,
    NUM_LETTERS,
    chain_problems,
    load_chain_task,
    make_problem,
    split_of,
    verify_chain,
)

DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo-model"


def solve_from_text(problem: str) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Reference solver written independently of the generator: parse the facts, walk start -> end."""
    values = dict(re.findall(r"(?<!\S)([a-z])=(\d)(?!\S)", problem))
    successors = dict(re.findall(r"(?<!\S)([a-z])>([a-z])(?!\S)", problem))
    start, end = re.search(r"; start ([a-z]) end ([a-z]) \.$", problem).groups()
    path = [start]
    while path[-1] != end:
        path.append(successors[path[-1]])
    return path, values, successors


def test_generator_is_deterministic_in_seed_and_split():
    a = load_chain_task("test", num=20, seed=3)
    b = load_chain_task("test", num=20, seed=3)
    c = load_chain_task("test", num=20, seed=4)
    assert a.to_dict() == b.to_dict()
    assert set(a["problem"]).isdisjoint(c["problem"])
    assert a.column_names == ["problem", "answer", "source", "solution"]
    assert set(a["source"]) == {"chain"}


def test_splits_are_disjoint_by_construction():
    train = {p.problem for p in chain_problems("train", 400, seed=0)}
    val = {p.problem for p in chain_problems("validation", 200, seed=0)}
    test = {p.problem for p in chain_problems("test", 200, seed=0)}
    assert len(train) == 400 and len(val) == 200 and len(test) == 200
    assert train.isdisjoint(test) and train.isdisjoint(val) and val.isdisjoint(test)
    assert {split_of(p) for p in test} == {"test"}
    assert {split_of(p) for p in train} == {"train"}


def test_bad_split_and_num_are_rejected():
    with pytest.raises(ValueError, match="split='dev'"):
        load_chain_task("dev")
    with pytest.raises(ValueError, match="num=-1"):
        chain_problems("test", -1)


def test_problems_match_an_independent_solver():
    for p in chain_problems("test", 50, seed=1):
        path, values, successors = solve_from_text(p.problem)
        assert MIN_STEPS <= len(path) <= MAX_STEPS
        assert p.answer == values[path[-1]]
        walk = [f"{v}={values[v]} {v}>{successors[v]}" for v in path[:-1]]
        end = path[-1]
        assert p.solution == " ".join([path[0], *walk, f"{end}={values[end]}", f"\\boxed{{{p.answer}}}"])
        letters = sorted(values)
        assert len(letters) == NUM_LETTERS and set(letters) <= set(LETTERS)
        assert sorted(successors) == letters
        assert sorted(successors.values()) == letters  # successors: a permutation...
        v, seen = path[0], set()
        while v not in seen:
            seen.add(v)
            v = successors[v]
        assert len(seen) == NUM_LETTERS  # ...and one cycle through all the problem's letters


def test_facts_lie_far_back_from_where_the_solution_needs_them():
    """Most facts a solution copies are > sink 16 + local 64 words before the word that needs them."""
    far = total = 0
    for p in chain_problems("test", 50, seed=2):
        words = p.problem.split() + p.solution.split()
        prompt_len = len(p.problem.split())
        for i, word in enumerate(p.solution.split()[1:-1], start=prompt_len + 1):
            distance = i - words.index(word)  # the fact's only occurrence in the prompt
            total += 1
            far += distance > 64 and words.index(word) >= 16
    assert far / total > 0.75


def test_curriculum_problems_are_shorter_but_well_formed():
    p = make_problem(random.Random(0), 4, 6, num_letters=8, body_words=40)
    path, values, successors = solve_from_text(p.problem)
    assert 4 <= len(path) <= 6 and p.answer == values[path[-1]] and len(successors) == 8
    assert len(p.problem.split()) == len(HEADER.split()) + 40 + 6
    with pytest.raises(ValueError, match="body_words=10"):
        make_problem(random.Random(0), num_letters=8, body_words=10, min_steps=4, max_steps=6)
    with pytest.raises(ValueError, match="num_letters=1"):
        make_problem(random.Random(0), num_letters=1)


def test_verifier_accepts_reference_and_rejects_wrong_answers():
    p = make_problem(random.Random(0))
    wrong = str((int(p.answer) + 1) % 10)
    assert verify_chain(p.solution, p.answer)
    assert verify_chain("<think>\\boxed{" + wrong + "}</think> " + p.solution, p.answer)
    assert not verify_chain(p.solution.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{wrong}}}"), p.answer)
    assert not verify_chain(p.solution.rsplit(" ", 1)[0], p.answer)  # no boxed answer
    assert not verify_chain(f"\\boxed{{{p.answer}}} then \\boxed{{{wrong}}}", p.answer)  # the last box counts


def test_verifier_is_what_the_dataset_verifier_dispatches_to():
    from rlkv.verifiers.verify import verify

    row = load_chain_task("test", num=1)[0]
    assert verify(row["solution"], row)
    assert not verify(row["solution"].replace("boxed", "text"), row)


@pytest.fixture(scope="module")
def demo_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(DEMO_MODEL)


@pytest.fixture(scope="module")
def demo_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()


def test_sequences_are_long_with_the_shipped_tokenizer(demo_tokenizer):
    tok = demo_tokenizer
    for row in load_chain_task("test", num=100, seed=0):
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": row["problem"]}], tokenize=False, add_generation_prompt=True
        )
        prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        solution_ids = tok(row["solution"], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in prompt_ids + solution_ids
        assert len(prompt_ids) + len(solution_ids) >= 300
        assert tok.decode(solution_ids) == row["solution"]


def test_shipped_tokenizer_round_trips(demo_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    tok = demo_tokenizer
    assert tok.padding_side == "left"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|pad|>"
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "start a ;"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nstart a ;<|im_end|>\n<|im_start|>assistant\n"
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.get_vocab() == tok.get_vocab()
    assert again.chat_template == tok.chat_template
    text = load_chain_task("test", num=1)[0]["problem"]
    assert again(text)["input_ids"] == tok(text)["input_ids"]


def test_shipped_model_config_round_trips(demo_model, tmp_path):
    from transformers import AutoConfig

    config = demo_model.config
    assert config.model_type == "llama"  # not qwen2: AutoTokenizer would force a byte-level tokenizer on it
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.max_position_embeddings >= 1024
    size = (DEMO_MODEL / "model.safetensors").stat().st_size
    assert size <= 25 * 2**20
    config.save_pretrained(tmp_path)
    again = AutoConfig.from_pretrained(tmp_path).to_dict()
    assert {k: v for k, v in again.items() if k != "_name_or_path"} == {
        k: v for k, v in config.to_dict().items() if k != "_name_or_path"
    }


def test_shipped_model_is_the_trained_one(demo_model, demo_tokenizer):
    """Greedy decoding with left padding copies the right facts from far back in the prompt.

    The first three solution words are the start letter, its digit fact and its successor fact,
    which lie anywhere in the document; a random model of the same config writes neither.
    (Held-out accuracy is measured by the build script and recorded in assets/demo-model/eval.json.)
    """
    tok = demo_tokenizer
    problems = list(load_chain_task("test", num=6, seed=0)["problem"])
    problems.append(make_problem(random.Random(1), body_words=BODY_WORDS - 70).problem)  # ragged batch
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
        for p in problems
    ]
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc["attention_mask"][-1] == 0).sum() == 70  # left-padded
    with torch.no_grad():
        out = demo_model.generate(**enc, max_new_tokens=3, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    expected = []
    for p in problems:
        path, values, successors = solve_from_text(p)
        v = path[0]
        expected.append(f"{v} {v}={values[v]} {v}>{successors[v]}")
    assert texts == expected
