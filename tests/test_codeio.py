"""CodeI/O items as write-the-function problems: offline, seeded, split-disjoint, checked by running the code."""

import json

import pytest

from rlkv.data import ProblemDataError, build_prompt, load_problems, verify
from rlkv.data.codeio import codeio_metadata, codeio_problem
from rlkv.testing import tiny_tokenizer

QUESTION = """
You are given a question that requires some input and output variables as follows:

Add two numbers.

The input and output requirements are as follows:

Input:
  `a` (int): the first.
  `b` (float): the second.

Output:
  `return` (dict): the sum under "total" and the inputs as a list under "parts".

Given the following input:

{'a': 1, 'b': 2.5}

Can you predict the output without writing any code?

Tip: Here is a reference code snippet for this question.

def main_solution(a, b):
    return {"total": a + b, "parts": [a, b]}
"""


def _example(output=None):
    meta = codeio_metadata(
        {"input_data": {"a": 1, "b": 2.5}, "output_data": output or {"total": 3.5, "parts": [1, 2.5]}}
    )
    return {
        "problem": codeio_problem(QUESTION),
        "answer": "",
        "source": "codeio",
        "metadata": json.dumps(meta),
    }


def _code(body: str) -> str:
    return f"Here it is.\n```python\ndef main_solution(a, b):\n    {body}\n```"


def test_problem_keeps_the_task_and_drops_the_pair_and_the_reference_code():
    problem = codeio_problem(QUESTION)
    assert problem.startswith("Add two numbers.") and "`b` (float): the second." in problem
    assert "main_solution" in problem.splitlines()[-1]
    for leaked in ("Given the following", "2.5}", "Tip:", "return {"):
        assert leaked not in problem
    with pytest.raises(ProblemDataError, match="CodeI/O layout"):
        codeio_problem("Add two numbers.")


@pytest.mark.parametrize(
    "body, passes",
    [
        ('return {"total": a + b, "parts": [a, b]}', True),
        (
            'return {"total": a + b + 1e-9, "parts": (a, b)}',
            True,
        ),  # floats to rel 1e-6; tuples are JSON lists
        ('return {"total": a + b + 1e-3, "parts": [a, b]}', False),
        ('return {"total": a + b, "parts": [a, b], "extra": 0}', False),
        ('return {"total": str(a + b), "parts": [a, b]}', False),
        ('return {"total": True, "parts": [a, b]}', False),
        ("return object()", False),  # not JSON
        ("raise ValueError", False),
    ],
)
def test_verifier_runs_the_function_on_the_items_input(body, passes):
    assert verify(_code(body), _example()) is passes


def test_metadata_errors_name_the_field():
    with pytest.raises(ProblemDataError, match="'output_data'"):
        codeio_metadata({"input_data": {}})
    with pytest.raises(ProblemDataError, match="input_data.*dict"):
        codeio_metadata({"input_data": [1], "output_data": 1})


def test_loader_is_offline_seeded_split_disjoint_and_prompts_as_code():
    a = load_problems("codeio", num=4, seed=2)
    assert a.to_list() == load_problems("codeio", num=4, seed=2).to_list() and len(a) == 4
    test = load_problems("codeio", split="test", num=4, seed=2)
    seeds = [{json.loads(m)["item_seed"] for m in ds["metadata"]} for ds in (a, test)]
    assert not seeds[0] & seeds[1]
    for row in a:
        assert row["source"] == "codeio" and "Tip:" not in row["problem"]
        assert json.loads(row["metadata"])["entry_point"] == "main_solution"
        assert "Python" in build_prompt(row, tiny_tokenizer(), "auto")  # the code template


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_joined_sets_concatenate_in_order_and_refuse_mixed_kinds(tmp_path):
    rows = [{"problem": f"p{i}", "answer": str(i), "source": "math"} for i in range(5)]
    first, second = _write(tmp_path / "a.jsonl", rows[:2]), _write(tmp_path / "b.jsonl", rows[2:])
    joined = load_problems(f"{first}+{second}")
    assert joined["problem"] == ["p0", "p1", "p2", "p3", "p4"]
    sample = load_problems(f"{first} + {second}", num=3, seed=0)
    assert len(sample) == 3 and set(sample["problem"]) <= set(joined["problem"])
    curriculum = _write(tmp_path / "c.jsonl", [{**rows[0], "prompt": "q", "completion": "c"}])
    with pytest.raises(ProblemDataError, match="join sets of one kind"):
        load_problems(f"{first}+{curriculum}")
    with pytest.raises(ProblemDataError, match="empty name"):
        load_problems(f"{first}+")
