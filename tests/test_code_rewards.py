"""The code reward cannot be gamed: only tests that ran to their last line and passed report success.

Each probe is a wrong solution plus a way to end or subvert the run that the former check (exit
status 0 of program + tests) counted as passed. Run at the guard level (the OS sandbox changes
nothing here; the probes are about the harness, not containment).
"""

import json

import pytest

from rlkv import sandbox
from rlkv.data import verify
from rlkv.verifiers.verify import run_python_tests

WRONG = "def add(a, b):\n    return a - b\n"
RIGHT = "def add(a, b):\n    return a + b\n"
MBPP_TESTS = "assert add(2, 2) == 4\nassert add(1, 5) == 6"
HUMANEVAL_TESTS = (
    "METADATA = {}\n\ndef check(candidate):\n"
    "    assert candidate(2, 2) == 4\n    assert candidate(1, 5) == 6\n\ncheck(add)\n"
)

EARLY_EXITS = {
    "sys.exit(0)": "import sys\nsys.exit(0)",
    "sys.exit()": "import sys\nsys.exit()",
    "os._exit(0)": "import os\nos._exit(0)",
    "raise SystemExit(0)": "raise SystemExit(0)",
    "raise SystemExit": "raise SystemExit",
    "exit()": "exit()",
    "quit()": "quit()",
    "builtins.exit(0)": "import builtins\nbuiltins.exit(0)",
    "atexit os._exit": "import atexit, os\natexit.register(os._exit, 0)",
    "excepthook os._exit": "import os, sys\nsys.excepthook = lambda *a: os._exit(0)",
    "timer os._exit": (
        "import os, signal, time\nsignal.signal(signal.SIGALRM, lambda *a: os._exit(0))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.01)\ntime.sleep(5)"
    ),
    "thread os._exit": (
        "import os, threading, time\nthreading.Thread(target=os._exit, args=(0,)).start()\ntime.sleep(5)"
    ),
    "marker on every fd": (
        "import json, os\nline = 'rlkv-sandbox-result:' + json.dumps({'returncode': 0, 'timed_out': False, "
        "'limit': None, 'tests_passed': True}) + '\\n'\nfor fd in range(1, 64):\n    try:\n"
        "        os.write(fd, line.encode() + os.urandom(64).hex().encode())\n    except OSError:\n        pass\n"
        "os._exit(0)"
    ),
    "kill itself": "import os, signal\nsignal.raise_signal(signal.SIGKILL)",
    "interrupt itself": "import os, signal\nsignal.raise_signal(signal.SIGINT)",
}


@pytest.fixture(autouse=True)
def _guard_level(monkeypatch):
    monkeypatch.setenv(sandbox.CONTAINMENT_ENV, "guard")


@pytest.mark.parametrize("tests", [MBPP_TESTS, HUMANEVAL_TESTS], ids=["mbpp", "humaneval"])
@pytest.mark.parametrize("ending", list(EARLY_EXITS.values()), ids=list(EARLY_EXITS))
def test_ending_the_run_early_never_passes(ending, tests):
    assert not run_python_tests(WRONG + ending, tests, timeout_s=5)


@pytest.mark.parametrize("tests", [MBPP_TESTS, HUMANEVAL_TESTS], ids=["mbpp", "humaneval"])
def test_a_correct_program_passes_and_a_wrong_one_fails(tests):
    assert run_python_tests(RIGHT, tests, timeout_s=5)
    assert not run_python_tests(WRONG, tests, timeout_s=5)


def test_the_issue_example_through_verify():
    example = {"source": "mbpp", "answer": "", "metadata": {"test_code": "assert add(2, 2) == 4"}}
    assert not verify("```python\ndef add(a, b): return a - b\nimport sys; sys.exit(0)\n```", example)
    assert verify("```python\ndef add(a, b): return a + b\n```", example)


def test_replacing_a_later_test_function_never_passes():
    """The solution, called by the first test function, rebinds the second to a no-op."""
    tests = "def check(candidate):\n    assert candidate(1, 1) == 2\n\ndef check2(candidate):\n"
    tests += "    assert candidate(2, 3) == 5\n\ncheck(add)\ncheck2(add)\n"
    cheat = "def add(a, b):\n    globals()['check2'] = lambda candidate: None\n    return 2\n"
    assert not run_python_tests(cheat, tests, timeout_s=5)
    deleting = cheat.replace("globals()['check2'] = lambda candidate: None", "globals().pop('check2', None)")
    assert not run_python_tests(deleting, tests, timeout_s=5)
    assert run_python_tests(RIGHT, tests, timeout_s=5)


def test_reporting_success_from_the_program_never_passes():
    """The harness's reporter is reachable from the test namespace; called by anything but the tests'
    last line it refuses."""
    cheat = "def add(a, b):\n    globals()['__rlkv_tests_done__']()\n    return 0\n"
    assert not run_python_tests(cheat, MBPP_TESTS, timeout_s=5)


def test_swallowing_the_tests_never_passes():
    """Program text that would turn the appended tests into a string, a comment or dead code."""
    for tail in ('x = """', "if False:", "x = (", "# \\"):
        assert not run_python_tests(WRONG + tail, MBPP_TESTS, timeout_s=5)


def test_ordinary_programs_still_pass():
    program = (
        "import collections, dataclasses, functools, heapq, itertools, math, re, typing\n"
        "Point = collections.namedtuple('Point', 'x y')\n"
        "T = typing.TypeVar('T')\n"
        "@dataclasses.dataclass\nclass Box:\n    v: int\n"
        "@functools.lru_cache(None)\ndef fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
        "def add(a, b):\n    print('adding', a, b)\n    open('scratch.txt', 'w').write('x')\n"
        "    return Box(Point(a, b).x).v + b\n"
        "if __name__ == '__main__':\n    assert fib(10) == 55\n"
    )
    assert run_python_tests(program, HUMANEVAL_TESTS, timeout_s=10)
    # program and tests compile apart: a future import is the program's first line again
    assert run_python_tests("from __future__ import annotations\n" + RIGHT, MBPP_TESTS, timeout_s=5)


@pytest.mark.parametrize("timeout", ["nan", 1e12, "abc", -1, 0, True, [5], "inf"])
def test_bad_timeout_metadata_is_a_problem_data_error(timeout):
    from rlkv.errors import ProblemDataError

    example = {
        "source": "mbpp",
        "answer": "",
        "metadata": json.dumps({"test_code": "pass", "timeout_s": timeout}),
    }
    with pytest.raises(ProblemDataError, match=r"metadata\['timeout_s'\]"):
        verify("```python\npass\n```", example)


@pytest.mark.parametrize("metadata", [[1, 2], "not json", "[1]", 5])
def test_bad_metadata_is_a_problem_data_error(metadata):
    from rlkv.errors import ProblemDataError

    with pytest.raises(ProblemDataError, match="metadata"):
        verify("```python\npass\n```", {"source": "mbpp", "answer": "", "metadata": metadata})
