"""Reward functions in TRL's signature: boxed math answers, the per-source verifier hook, robustness."""

from __future__ import annotations

import json
import threading

import pytest

from rlkv.data.chain_task import chain_problems
from rlkv.trainers.rewards import (
    boxed_math_reward,
    completion_text,
    get_reward,
    reward_from_verifier,
    verifier_reward,
)

TRL_EXTRAS = {
    "completion_ids": [[1], [2], [3]],
    "trainer_state": None,
    "log_extra": print,
    "log_metric": print,
}


def test_boxed_math_reward_scores_equivalent_answers_and_rejects_wrong_or_garbage():
    completions = [
        "so x = 1/2. Therefore, the final answer is: $\\boxed{\\frac{1}{2}}$. I hope it is correct",
        "Therefore, the final answer is: $\\boxed{0.25}$.",
        "no box here, 0.5",
        "\\boxed{\\frac{1}{",  # unclosed
        "<think>\\boxed{0.5}</think> the answer is \\boxed{3}",  # reasoning before </think> is ignored
    ]
    answers = ["0.5", "0.5", "0.5", "0.5", "0.5"]
    assert boxed_math_reward(["p"] * 5, completions, answer=answers) == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_conversational_completions_use_the_last_message():
    completion = [{"role": "assistant", "content": "it is \\boxed{12}"}]
    assert completion_text(completion) == "it is \\boxed{12}"
    blocks = [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "\\boxed{"}, {"type": "text", "text": "7}"}],
        }
    ]
    assert boxed_math_reward([[]], [blocks], answer=["7"]) == [1.0]


def test_math_reward_works_off_the_main_thread():
    """TRL may score in worker threads; math-verify's signal-based timeout must not break there."""
    result = []
    thread = threading.Thread(
        target=lambda: result.append(boxed_math_reward(["p"], ["\\boxed{\\frac{2}{4}}"], answer=["1/2"]))
    )
    thread.start()
    thread.join(30)
    assert result == [[1.0]]


def test_verifier_reward_dispatches_on_source_with_dataset_columns_as_kwargs():
    problem = chain_problems("train", num=1, seed=3)[0]
    completions = [
        problem.solution,
        problem.solution.replace(f"\\boxed{{{problem.answer}}}", "\\boxed{x}"),
        "\\boxed{4}",
    ]
    scores = verifier_reward(
        ["p"] * 3,
        completions,
        source=["chain", "chain", "gsm8k"],
        answer=[problem.answer, problem.answer, "4"],
        metadata=["{}"] * 3,
        **TRL_EXTRAS,
    )
    assert scores == [1.0, 0.0, 1.0]


def test_verifier_reward_unknown_source_is_a_clear_configuration_error():
    with pytest.raises(KeyError, match="no verifier for source 'nope'"):
        verifier_reward(["p"], ["x"], source=["nope"], answer=["1"])


def test_reward_from_verifier_passes_rows_and_turns_exceptions_into_zero():
    seen = []

    def judge(text: str, example: dict) -> float:
        seen.append(example)
        if text == "boom":
            raise RuntimeError("verifier crashed")
        return 0.25 * len(text)

    reward = reward_from_verifier(judge, name="judge")
    meta = [json.dumps({"k": i}) for i in range(3)]
    scores = reward(
        ["a", "b", "c"], ["x", "boom", "xyz"], answer=["1", "2", "3"], metadata=meta, **TRL_EXTRAS
    )
    assert scores == [0.25, 0.0, 0.75]
    assert reward.__name__ == "judge"
    assert seen[2] == {"answer": "3", "metadata": meta[2]}, (
        "TRL's extra kwargs must not leak into the example"
    )


def test_get_reward_by_name_and_import_path():
    assert get_reward("math") is boxed_math_reward
    assert get_reward("verify") is verifier_reward
    assert get_reward("rlkv.trainers.rewards:boxed_math_reward") is boxed_math_reward
    with pytest.raises(ValueError, match="unknown reward 'mathh'"):
        get_reward("mathh")
    with pytest.raises(ValueError, match="cannot import"):
        get_reward("rlkv.trainers.rewards:nothing_here")
