"""CodeI/O items (reasoning-gym's `codeio`) as write-the-function code problems, offline.

reasoning-gym ships CodeI/O's problems (a description, the input/output requirements, a reference
program and one input/output pair) to ask for an input or an output. Here the same items ask for
the program: "write `main_solution`", checked by running it on the item's input and comparing its
JSON-able result with the item's output (floats to a relative 1e-6). They give a code curriculum
without touching HumanEval or MBPP, for example the code half of a distillation set.
"""

from __future__ import annotations

import json
from typing import Any

from rlkv.errors import ProblemDataError

ENTRY_POINT = "main_solution"
_INTRO = "You are given a question that requires some input and output variables as follows:"
_ASK_MARK = "\n\nGiven the following "
_INSTRUCTION = (
    "Write a Python function `main_solution` that takes the inputs above as keyword arguments (with "
    "exactly those names) and returns the output, using only JSON-serializable values (lists, dicts, "
    "strings, numbers, booleans, None)."
)
# Runs after the model's code in the sandbox; INPUT / OUTPUT are JSON texts.
_TEST_TEMPLATE = """import json as _json
import math as _math


def _close(got, want):
    if isinstance(want, float) or isinstance(got, float):
        numbers = (int, float)
        return (
            isinstance(got, numbers) and isinstance(want, numbers) and not isinstance(got, bool)
            and _math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        )
    if isinstance(want, list) and isinstance(got, list):
        return len(got) == len(want) and all(_close(g, w) for g, w in zip(got, want))
    if isinstance(want, dict) and isinstance(got, dict):
        return got.keys() == want.keys() and all(_close(got[k], want[k]) for k in want)
    return type(got) is type(want) and got == want


_got = _json.loads(_json.dumps({entry}(**_json.loads({inputs!r}))))
assert _close(_got, _json.loads({output!r})), _got
"""


def codeio_problem(question: str) -> str:
    """The write-the-function problem text of a reasoning-gym `codeio` question (its description and
    input/output requirements, without the asked-for pair or the reference code).

    Raises ProblemDataError when the question is not in reasoning-gym's CodeI/O layout.
    """
    text = question.strip()
    if not text.startswith(_INTRO) or _ASK_MARK not in text:
        raise ProblemDataError(
            "codeio: question is not in reasoning-gym's CodeI/O layout (intro line, then 'Given the following')"
        )
    description = text[len(_INTRO) : text.index(_ASK_MARK)].strip()
    return f"{description}\n\n{_INSTRUCTION}"


def codeio_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """`verify_code` metadata (entry point and test code) from a `codeio` entry's metadata.

    Raises ProblemDataError naming the field when the input/output pair is missing or not JSON.
    """
    for field in ("input_data", "output_data"):
        if field not in metadata:
            raise ProblemDataError(f"codeio: entry metadata has no {field!r}")
    inputs = metadata["input_data"]
    if not isinstance(inputs, dict):
        raise ProblemDataError(
            f"codeio: metadata['input_data'] must be a dict of arguments, got {type(inputs).__name__}"
        )
    try:
        inputs_json, output_json = json.dumps(inputs), json.dumps(metadata["output_data"])
    except (TypeError, ValueError) as e:
        raise ProblemDataError(f"codeio: input/output pair is not JSON ({e})") from None
    test_code = _TEST_TEMPLATE.format(entry=ENTRY_POINT, inputs=inputs_json, output=output_json)
    return {"entry_point": ENTRY_POINT, "test_code": test_code, "source_index": metadata.get("source_index")}
