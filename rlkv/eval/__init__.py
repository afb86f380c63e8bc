"""Evaluation harness: methods x sparsities x benchmarks at matched KV budgets, error modes, reports.

`run_eval(EvalConfig(...))` writes results.jsonl (resumable) and, through `write_report`, report.md
and PNG plots; `run_sensitivity` runs the head-sensitivity sweep. Method names and the
budget-matching rule are in `rlkv.eval.methods`; the error-mode rules in `rlkv.eval.error_modes`.
`full_kv_solutions` turns a folder's full-KV rows into token sequences (`rlkv mask-nll --solutions-from`).
"""

from rlkv.eval.config import EvalConfig
from rlkv.eval.error_modes import ERROR_MODES, RepetitionRule, RepetitionStop, classify_error
from rlkv.eval.methods import BudgetRule, MethodError, matched_tokens_per_head, method_config, parse_method
from rlkv.eval.results import current_results, read_results
from rlkv.eval.runner import run_eval, run_sensitivity
from rlkv.eval.solutions import full_kv_solutions

__all__ = [
    "ERROR_MODES",
    "BudgetRule",
    "EvalConfig",
    "MethodError",
    "RepetitionRule",
    "RepetitionStop",
    "classify_error",
    "matched_tokens_per_head",
    "method_config",
    "parse_method",
    "current_results",
    "full_kv_solutions",
    "read_results",
    "run_eval",
    "run_sensitivity",
]
