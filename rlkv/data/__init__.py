"""Problem datasets, prompt templates, answer verification and the self-distilled length curriculum."""

from rlkv.data import chain_task  # noqa: F401  (registers the "chain" verifier)
from rlkv.data.curriculum import CurriculumConfig, CurriculumError, CurriculumResult, build_curriculum
from rlkv.data.loaders import ProblemDataError, load_problems, problem_sources
from rlkv.data.prompts import PROMPT_TEMPLATES, build_prompt, format_problem, register_template
from rlkv.data.records import SCHEMA_COLUMNS
from rlkv.data.verify import (
    extract_boxed,
    extract_code,
    get_verifier,
    register_verifier,
    strip_thinking,
    verify,
    verify_code,
    verify_math,
)

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
