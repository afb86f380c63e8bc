"""Answer verification: math-verify on boxed answers, code tests in a subprocess, the source registry."""

import json
import threading

import pytest

from rlkv.data import extract_boxed, get_verifier, register_verifier, verify, verify_math


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"so the answer is \boxed{\frac{1}{2}}", "0.5"),
        (r"\boxed{0.5}", r"\frac{1}{2}"),
        (r"Therefore, the final answer is: $\boxed{x^2+1}$. I hope it is correct", "1+x^2"),
        (r"\boxed{\dfrac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
        (r"\boxed{18}", "$18$"),
        (r"\boxed{18}", r"\boxed{18}"),
        (r"\boxed{1,000}", "1000"),
        (r"first \boxed{3} then corrected: \boxed{4}", "4"),
        (r"<think>maybe \boxed{5}</think> so \boxed{6}", "6"),
    ],
)
def test_verify_math_accepts_equivalent_answers(completion, answer):
    assert verify_math(completion, answer)


@pytest.mark.parametrize(
    "completion, answer",
    [
        (r"\boxed{3}", "4"),
        (r"\boxed{\frac{1}{3}}", "0.5"),
        (r"the answer is 0.5", "0.5"),  # no boxed answer
        (r"\boxed{4} then \boxed{3}", "4"),  # only the last box counts
        (r"<think>\boxed{5}</think> answer 5", "5"),  # boxed only inside the thinking
        (r"\boxed{\frac{1}{", "0.5"),  # unclosed
        (r"\boxed{}", "0"),
        (r"\boxed{5}", ""),
    ],
)
def test_verify_math_rejects_wrong_or_missing_answers(completion, answer):
    assert not verify_math(completion, answer)


def test_extract_boxed_balanced_and_last():
    assert extract_boxed(r"\boxed{a} and \fbox{b{c}d}") == "b{c}d"
    assert extract_boxed(r"\boxed{\frac{1}{2}} tail") == r"\frac{1}{2}"
    assert extract_boxed(r"\boxed{ok} then \boxed{unclosed") == "ok"
    assert extract_boxed("nothing") is None


def test_verify_math_off_the_main_thread():
    results = {}

    def work(i, completion, answer):
        results[i] = verify_math(completion, answer)

    threads = [
        threading.Thread(target=work, args=(0, r"\boxed{\frac{1}{2}}", "0.5")),
        threading.Thread(target=work, args=(1, r"\boxed{7}", "8")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: True, 1: False}


def _code_example(test_code, **meta):
    return {
        "source": "mbpp",
        "problem": "",
        "answer": "",
        "metadata": json.dumps({"test_code": test_code, **meta}),
    }


def test_code_verifier_runs_real_tests():
    example = _code_example("assert add(2, 3) == 5\nassert add(-1, 1) == 0")
    good = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a - b\n```"
    crash = "```python\ndef add(a, b):\n    raise RuntimeError\n```"
    assert verify(good, example)
    assert not verify(bad, example)
    assert not verify(crash, example)


def test_code_verifier_timeout_and_no_network():
    loop = _code_example("assert f() == 1", timeout_s=1)
    assert not verify("```python\ndef f():\n    while True:\n        pass\n```", loop)
    net = _code_example("assert f() == 1")
    code = "```python\nimport socket\ndef f():\n    socket.create_connection(('127.0.0.1', 9))\n    return 1\n```"
    assert not verify(code, net)


def test_code_verifier_prepends_prompt_for_bodies():
    meta = {
        "entry_point": "inc",
        "prefix": "def inc(x):\n",
        "test_code": "def check(f):\n    assert f(1) == 2\ncheck(inc)",
    }
    example = {"source": "humaneval", "answer": "", "metadata": json.dumps(meta)}
    assert verify("    return x + 1\n", example)
    assert verify("```python\ndef inc(x):\n    return x + 1\n```", example)
    assert not verify("    return x\n", example)


def test_reasoning_gym_verifier_uses_its_scorer():
    meta = {"source_dataset": "basic_arithmetic", "expression": "5 - 3 - 6"}
    example = {
        "source": "reasoning_gym",
        "problem": "Calculate 5 - 3 - 6.",
        "answer": "-4",
        "metadata": json.dumps(meta),
    }
    assert verify(r"\boxed{-4}", example)
    assert not verify(r"\boxed{4}", example)
    assert not verify("-4", example)


def test_registry_dispatch_and_errors():
    register_verifier("test_exact", lambda completion, example: completion.strip() == example["answer"])
    assert verify(" yes ", {"source": "test_exact", "answer": "yes"})
    assert not verify("no", {"source": "test_exact", "answer": "yes"})
    assert get_verifier("gsm8k")(r"\boxed{12}", {"answer": "12"})
    with pytest.raises(KeyError, match="register_verifier"):
        verify("x", {"source": "nope", "answer": "x"})
    with pytest.raises(KeyError, match="source"):
        verify("x", {"answer": "x"})
