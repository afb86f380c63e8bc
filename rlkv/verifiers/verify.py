"""Answer verification: boxed-answer math checking, code tests, and a registry keyed by dataset source.

`verify(completion, example)` is what reward functions and the evaluation harness call: it
dispatches on `example["source"]` to the verifier registered for that source. Verifiers never
raise on bad model output (unparsable answers, crashing code, timeouts all count as wrong); bad
problem data (a missing or malformed `metadata` field) raises `ProblemDataError` naming the field.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping

from rlkv.errors import ProblemDataError
from rlkv.sandbox import run_program
from rlkv.verifiers.answers import extract_boxed, strip_thinking

logger = logging.getLogger(__name__)

Verifier = Callable[[str, dict], bool]

MATH_TIMEOUT_S = 5
CODE_TIMEOUT_S = 10.0
MAX_CODE_TIMEOUT_S = 3600.0


def _gold_latex(answer: str) -> str:
    """The gold answer as a `$...$` LaTeX span math-verify can parse (accepts raw, `$..$` or boxed forms)."""
    answer = str(answer).strip()
    boxed = extract_boxed(answer)
    if boxed is not None:
        answer = boxed
    answer = answer.strip("$").strip()
    return f"${answer}$"


def _math_verify(pred: str, gold: str, timeout: int | None) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse
    from math_verify import verify as mv_verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(_gold_latex(gold), extraction_config=configs, parsing_timeout=timeout)
    pred_parsed = parse(f"${pred}$", extraction_config=configs, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(mv_verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def _run_bounded(fn: Callable[[], bool], timeout_s: float) -> bool:
    """Run `fn` in a daemon thread, False if it raises or takes longer than `timeout_s`.

    math-verify bounds its time with signal.alarm, which only works in the main thread; off it
    we disable that and bound the caller's wait instead (a runaway sympy call keeps running in
    its daemon thread but cannot block the caller).
    """
    result: list[bool] = []

    def target() -> None:
        try:
            result.append(fn())
        except Exception:  # bad model output must never crash a reward function
            logger.debug("verifier raised", exc_info=True)

    worker = threading.Thread(target=target, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return bool(result and result[0])


def verify_math(completion: str, answer: str, timeout_s: int = MATH_TIMEOUT_S) -> bool:
    """True when the last `\\boxed{}` answer of `completion` equals `answer` (math-verify, symbolic/numeric).

    `answer` may be raw ("0.5"), LaTeX ("\\frac{1}{2}") or boxed. Text before `</think>` is ignored.
    Never raises: no boxed answer, parse failures and timeouts give False. Safe in any thread.
    """
    pred = extract_boxed(strip_thinking(completion))
    if pred is None or not str(answer).strip():
        return False
    if threading.current_thread() is threading.main_thread():
        try:
            return _math_verify(pred, answer, timeout_s)
        except Exception:
            logger.debug("math-verify raised", exc_info=True)
            return False
    return _run_bounded(lambda: _math_verify(pred, answer, None), 2 * timeout_s)


_CODE_BLOCK_RE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(completion: str) -> str:
    """The last fenced code block of a completion (after `</think>`); the whole answer if it has none."""
    text = strip_thinking(completion)
    blocks = _CODE_BLOCK_RE.findall(text)
    return blocks[-1] if blocks else text


def run_python_tests(
    program: str,
    test_code: str,
    timeout_s: float = CODE_TIMEOUT_S,
    *,
    setup: str | None = None,
    entry_point: str | None = None,
) -> bool:
    """True when `test_code`, run against `program`, ran to its end within `timeout_s`.

    The program and the tests run in two contained interpreters (`rlkv.sandbox`): the tests
    call the program's functions through proxies, arguments and return values cross as plain
    builtin data (a value whose `__eq__` says yes to anything arrives as a handle equal only to
    itself), and nothing of the tests is in the program's process. Success is reported by the tests'
    interpreter after their last line, over a channel the program cannot write, so a program that
    exits (even with status 0), kills itself, prints anything, walks its frames or rebinds names
    fails. `setup`: trusted code run before the tests in their interpreter (HumanEval's prompt: its
    helpers stay its own); `entry_point`: the one name the program may give even where the setup or
    the builtins define it. The containment level follows `RLKV_CODE_SANDBOX` (the OS sandbox where
    `unshare` works, else the guard); `SandboxError` when the required level is not available.
    """
    return run_program(program, timeout_s, tests=test_code, setup=setup, entry_point=entry_point).passed


def example_metadata(example: dict) -> dict:
    """The example's `metadata` column as a dict (stored as a JSON string in datasets; {} when absent).

    Raises `ProblemDataError` when it is neither a mapping nor a JSON object.
    """
    meta = example.get("metadata")
    if meta is None or meta == "":
        return {}
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except (ValueError, RecursionError) as e:
            raise ProblemDataError(
                f"example 'metadata' is not valid JSON ({e}); store a JSON object"
            ) from None
    if not isinstance(meta, Mapping):
        raise ProblemDataError(
            f"example 'metadata' must be a JSON object (a dict), got {type(meta).__name__}"
        )
    return dict(meta)


def _code_timeout(meta: dict) -> float:
    """`metadata['timeout_s']` as seconds in (0, MAX_CODE_TIMEOUT_S] (CODE_TIMEOUT_S when absent)."""
    value = meta.get("timeout_s", CODE_TIMEOUT_S)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value <= MAX_CODE_TIMEOUT_S
    if not ok:  # NaN fails the comparison too
        raise ProblemDataError(
            f"code example metadata['timeout_s']={value!r} must be a number of seconds in (0, {MAX_CODE_TIMEOUT_S}]"
        )
    return float(value)


def verify_code(completion: str, example: dict) -> bool:
    """Run the completion's code against `metadata["test_code"]` (plus `metadata["prefix"]` when the code lacks it).

    `metadata`: `test_code` (assertions / a `check(...)` call), optional `entry_point` (a name
    the code must define; if it does not, `prefix`, e.g. HumanEval's prompt, is prepended),
    optional `timeout_s` (seconds, default CODE_TIMEOUT_S, at most MAX_CODE_TIMEOUT_S). The prefix
    also runs before the tests in their own interpreter, so the helpers it defines are its own there
    (`run_python_tests`' `setup`). Bad model output gives False; bad problem data raises
    `ProblemDataError` naming the field.
    """
    meta = example_metadata(example)
    test_code = meta.get("test_code")
    if not test_code or not isinstance(test_code, str):
        raise ProblemDataError(
            f"code example from source {example.get('source')!r} has no metadata['test_code'] (a string of tests)"
        )
    for field in ("entry_point", "prefix"):
        if not isinstance(meta.get(field, ""), str):
            raise ProblemDataError(f"code example metadata[{field!r}] must be a string")
    timeout_s = _code_timeout(meta)
    code = extract_code(completion)
    entry_point = meta.get("entry_point")
    if entry_point and not re.search(rf"def\s+{re.escape(entry_point)}\s*\(", code):
        code = meta.get("prefix", "") + code
    setup = meta.get("prefix") or None  # the prompt's helpers (HumanEval/32's `poly`) run on the tests' side
    return run_python_tests(
        code, test_code, timeout_s=timeout_s, setup=setup, entry_point=entry_point or None
    )


def verify_reasoning_gym(completion: str, example: dict) -> bool:
    """Score with reasoning-gym's own scorer for `metadata["source_dataset"]`; correct when the score is 1."""
    import reasoning_gym

    meta = example_metadata(example)
    answer = extract_boxed(strip_thinking(completion))
    if answer is None:
        return False
    entry = {"question": example.get("problem", ""), "answer": example["answer"], "metadata": meta}
    score_fn = reasoning_gym.get_score_answer_fn(meta["source_dataset"])
    try:
        return float(score_fn(answer, entry)) >= 1.0
    except Exception:
        logger.debug("reasoning-gym scorer raised", exc_info=True)
        return False


def _verify_math_example(completion: str, example: dict) -> bool:
    return verify_math(completion, example["answer"])


MATH_SOURCES = ("gsm8k", "math500", "aime24", "aime25", "deepscaler", "champ", "math")
CODE_SOURCES = ("mbpp", "humaneval", "codeio")

_VERIFIERS: dict[str, Verifier] = {
    **dict.fromkeys(MATH_SOURCES, _verify_math_example),
    **dict.fromkeys(CODE_SOURCES, verify_code),
    "reasoning_gym": verify_reasoning_gym,
}  # "chain" registers itself in rlkv.data.chain_task (imported by the rlkv.data package)


def register_verifier(source: str, fn: Verifier) -> None:
    """Register (or replace) the verifier `fn(completion, example) -> bool` for examples whose `source` is `source`."""
    if not source:
        raise ValueError("register_verifier: source must be a non-empty string")
    _VERIFIERS[source] = fn


def get_verifier(source: str) -> Verifier:
    """The verifier registered for `source`."""
    try:
        return _VERIFIERS[source]
    except KeyError:
        raise KeyError(
            f"no verifier for source {source!r}; known: {sorted(_VERIFIERS)}. "
            "Register one with rlkv.data.register_verifier(source, fn)."
        ) from None


def check_verifiers(sources: Iterable[str], origin: str) -> None:
    """Raise `ProblemDataError` naming `origin` if any of `sources` has no registered verifier (before any work)."""
    missing = sorted(set(sources) - set(_VERIFIERS))
    if missing:
        raise ProblemDataError(
            f"{origin}: no verifier for source(s) {missing}; known: {sorted(_VERIFIERS)}. "
            "Register one with rlkv.data.register_verifier(source, fn), or fix the rows' `source`."
        )


def verify(completion: str, example: dict) -> bool:
    """True when `completion` correctly answers `example` (a dataset row with `source`, `answer`, optional `metadata`).

    Anything the completion does gives True or False. Bad problem data raises `ProblemDataError`
    naming the field (e.g. metadata['timeout_s'] = "nan"), an unusable code sandbox setting
    `SandboxError`, a missing `source` KeyError.
    """
    if "source" not in example:
        raise KeyError("verify: example has no 'source' field; rlkv.data loaders always set it")
    return bool(get_verifier(example["source"])(completion, example))
