"""Problem datasets, prompt templates and the self-distilled length curriculum; the verifiers' names
(`rlkv.verifiers`) re-exported."""

import importlib

from rlkv.data import chain_task  # noqa: F401  (registers the "chain" verifier)
from rlkv.data.curriculum import CurriculumConfig, CurriculumError, CurriculumResult, build_curriculum
from rlkv.data.loaders import ProblemDataError, load_problems, problem_sources
from rlkv.data.prompts import PROMPT_TEMPLATES, build_prompt, format_problem, register_template
from rlkv.data.records import SCHEMA_COLUMNS
from rlkv.verifiers import (
    extract_boxed,
    extract_code,
    get_verifier,
    register_verifier,
    strip_thinking,
    verify_code,
    verify_math,
)

# the old module paths rlkv.data.verify / .answers are deprecated shims (moved to rlkv.verifiers); importing
# a submodule binds its name on the package, so they load here and `verify` is bound to the function again
for _old in ("answers", "verify"):
    importlib.import_module(f"{__name__}.{_old}")
verify = importlib.import_module("rlkv.verifiers").verify  # the function, not the shim module bound above

__all__ = [
    "CurriculumConfig",
    "CurriculumError",
    "CurriculumResult",
    "build_curriculum",
    "PROMPT_TEMPLATES",
    "SCHEMA_COLUMNS",
    "ProblemDataError",
    "build_prompt",
    "extract_boxed",
    "extract_code",
    "format_problem",
    "get_verifier",
    "load_problems",
    "problem_sources",
    "register_template",
    "register_verifier",
    "strip_thinking",
    "verify",
    "verify_code",
    "verify_math",
]
