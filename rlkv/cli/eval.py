"""`rlkv eval --config recipes/eval/X.yaml` (or flags): methods x sparsities x benchmarks, resumable, with a report."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from rlkv.cli import add_vllm_arg, csv_fractions, csv_list
from rlkv.vllm_plugin.split import EVICTION_POLICIES

if TYPE_CHECKING:
    from rlkv.eval.config import EvalConfig

# the fields that name a report's cells (its row keys)
_GRID_FIELDS = {
    "benchmarks",
    "split",
    "exclude_problems",
    "methods",
    "sparsities",
    "num_problems",
    "num_samples",
    "seed",
}
# flag dest -> EvalConfig field, for flags that override the recipe
_OVERRIDES = (
    "model",
    "head_mask",
    "duo_mask",
    "ablation_mask",
    "benchmarks",
    "split",
    "methods",
    "sparsities",
    "num_problems",
    "max_new_tokens",
    "batch_size",
    "num_samples",
    "temperature",
    "budget_rule",
    "fixed_budget",
    "seed",
    "out",
    "dtype",
    "device",
    "engine",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `eval` subcommand."""
    parser = subparsers.add_parser(
        "eval",
        help="evaluate methods x sparsities x benchmarks at matched KV budgets (resumable)",
        description="Writes OUT/results.jsonl (one row per problem x method x sparsity; a rerun skips finished "
        "rows), OUT/report.md and PNG plots. Flags override the --config recipe's fields.",
    )
    parser.add_argument("--config", default=None, help="YAML recipe (see recipes/eval/)")
    parser.add_argument("--model", help="model path / hub id, or tiny:<family> for a random tiny model")
    parser.add_argument(
        "--head-mask",
        dest="head_mask",
        help="trained head mask (HeadMask.from_pretrained: folder, JSON, L x H_kv TSV, hub id)",
    )
    parser.add_argument("--duo-mask", dest="duo_mask", help="DuoAttention folder or TSV for the `duo` method")
    parser.add_argument(
        "--ablation-mask",
        dest="ablation_mask",
        help="head mask of `rlkv ablation-mask` for the `ablation-mask` method (same forms as --head-mask)",
    )
    parser.add_argument(
        "--benchmarks", type=csv_list, help="comma-separated problem sets (rlkv.data names or files)"
    )
    parser.add_argument("--split", help="dataset split (default test)")
    parser.add_argument(
        "--methods", type=csv_list, help="comma-separated, e.g. full,rlkv,rlkv+rkv,rkv,h2o,random-mask"
    )
    parser.add_argument(
        "--sparsities", type=csv_fractions, help="comma-separated fractions of KV heads compressed"
    )
    parser.add_argument("--num-problems", dest="num_problems", type=int)
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int)
    parser.add_argument("--batch-size", dest="batch_size", type=int)
    parser.add_argument(
        "--num-samples", dest="num_samples", type=int, help="samples per problem (needs --temperature)"
    )
    parser.add_argument("--temperature", type=float, help="0 = greedy")
    parser.add_argument("--budget-rule", dest="budget_rule", choices=("matched", "paper", "fixed"))
    parser.add_argument(
        "--fixed-budget", dest="fixed_budget", type=int, help="tokens per head for --budget-rule fixed"
    )
    parser.add_argument("--seed", type=int)
    parser.add_argument("--out", help="output folder (default eval-out)")
    parser.add_argument(
        "--dtype",
        help="auto (bf16 where the machine computes it natively, else fp32), bfloat16, float16 or float32; one "
        "dtype for both engines, recorded in every row",
    )
    parser.add_argument("--device", help="e.g. cuda, cpu")
    parser.add_argument(
        "--engine",
        choices=("transformers", "vllm"),
        help="vllm: full, the head-mask methods (sink + window after a full prompt, the transformers engine's "
        "form) and token eviction with " + ", ".join(EVICTION_POLICIES) + " (on every head or as "
        "<mask>+<policy>) on vLLM with rlkv's plugin; methods without a vLLM form (rpc, skipkv) on transformers "
        "in the same run, each row naming its engine (default transformers)",
    )
    add_vllm_arg(parser)
    parser.add_argument(
        "--window-only",
        action="store_true",
        help="the head-mask methods in the window-only form (a sliding window of sink + window tokens, sink 0, "
        "the prompt windowed) on either engine",
    )
    parser.add_argument(
        "--window-prefill",
        action="store_true",
        help="the head-mask methods' compressed heads attend sink + window in the prompt forward too (sink kept)",
    )
    parser.add_argument(
        "--no-static-cache",
        action="store_true",
        help="on CUDA, decode with the dynamic cache instead of the static, compiled one (same results)",
    )
    parser.add_argument("--no-early-stop", action="store_true", help="do not stop generations that loop")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument(
        "--sensitivity",
        nargs="?",
        type=int,
        const=0,
        default=None,
        metavar="STEPS",
        help="head-sensitivity sweep instead: full + rlkv/ablation-mask/random-mask/duo (whichever masks are "
        "set) at every k/N heads compressed (or STEPS + 1 evenly spaced counts, STEPS >= 2; all heads "
        "compressed runs once, as random-mask), written to OUT/sensitivity",
    )
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="only regenerate report.md and plots from OUT's rows: those of the grid the recipe and the "
        "grid flags (--benchmarks, --methods, --sparsities, ...) name; with --out alone, those the last run asked for; "
        "with --sensitivity, OUT/sensitivity's whole sweep",
    )
    parser.add_argument(
        "--redo",
        type=csv_list,
        default=[],
        metavar="METHODS",
        help="first drop every row of these methods from OUT/results.jsonl, so they run again "
        "(e.g. rlkv,rlkv+rkv after retraining the head mask)",
    )
    parser.set_defaults(func=_run)


def _eval_config(base: dict) -> EvalConfig:
    """The EvalConfig of a recipe mapping with its flag overrides; a bad field is a UserInputError."""
    from rlkv.errors import UserInputError
    from rlkv.eval.config import EvalConfig

    try:
        return EvalConfig.from_dict(base)
    except ValueError as e:
        raise UserInputError(str(e)) from None


def _run(args: argparse.Namespace) -> int:
    from rlkv._io import check_output_path
    from rlkv.errors import UserInputError
    from rlkv.eval.runner import run_eval

    base = {}
    if args.config:
        import yaml

        from rlkv._io import read_text_file

        text = read_text_file(args.config, what="eval recipe", error=UserInputError)
        try:
            base = yaml.safe_load(text) or {}
        except yaml.YAMLError as e:
            raise UserInputError(f"{args.config}: not valid YAML ({e})") from None
        if not isinstance(base, dict):
            raise UserInputError(f"{args.config}: an eval recipe must be a YAML mapping of config fields")
    for name in _OVERRIDES:
        value = getattr(args, name)
        if value is not None:
            base[name] = value
    if args.vllm_args and isinstance(
        base.get("vllm_kwargs", {}), dict
    ):  # else EvalConfig refuses the recipe's
        base["vllm_kwargs"] = {**base.get("vllm_kwargs", {}), **dict(args.vllm_args)}
    if args.no_static_cache:
        base["static_cache"] = False
    if args.window_only:
        base["window_only"] = True
    if args.window_prefill:
        base["window_prefill"] = True
    if args.no_early_stop:
        base["early_stop_repetition"] = False
    if args.no_progress:
        base["progress"] = False
    if args.report_only:
        from rlkv.eval.report import write_report

        folder = Path(base.get("out", "eval-out"))
        keys = None  # no grid named (or a sweep, whose keys file names all of it): the last run's cells
        if args.sensitivity is not None:
            folder = folder / "sensitivity"
        elif args.config or _GRID_FIELDS & set(base):
            from rlkv.eval.runner import grid_keys

            keys = grid_keys(_eval_config(base))
        print(write_report(folder, head_mask=_mask_only(base.get("head_mask")), keys=keys))
        return 0
    cfg = _eval_config(base)
    if args.vllm_args and cfg.engine != "vllm":
        raise UserInputError(
            "--vllm-arg without --engine vllm: the transformers engine takes no vLLM arguments"
        )
    check_output_path(cfg.out, what="eval folder (--out)", error=UserInputError)
    from rlkv.eval.sensitivity import sensitivity_methods
    from rlkv.eval.vllm_tasks import engine_plan

    methods = cfg.methods if args.sensitivity is None else sensitivity_methods(cfg)
    print(engine_plan(cfg.engine, methods))
    if args.redo:
        from rlkv.eval.results import drop_rows

        folder = Path(cfg.out) / ("sensitivity" if args.sensitivity is not None else "")
        print(f"--redo: dropped {drop_rows(folder, args.redo)} rows of {', '.join(args.redo)} from {folder}")
    with _printed_info(logging.getLogger("rlkv.eval.runner")):  # its end-of-run line on vLLM (engine starts)
        if args.sensitivity is not None:
            from rlkv.eval.runner import run_sensitivity

            out = run_sensitivity(cfg, steps=args.sensitivity or None)
        else:
            out = run_eval(cfg)
    print(out / "report.md")
    return 0


@contextlib.contextmanager
def _printed_info(logger: logging.Logger) -> Iterator[None]:
    """Print `logger`'s messages from INFO up (the message alone) on stdout while the block runs."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setLevel(logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _mask_only(path: str | None):
    """The trained head mask for the gate heatmap, without loading the model.

    None for no mask and for a scores-only TSV (file or RLKV/DuoAttention folder), which needs the model.
    """
    from rlkv.head_mask import MASK_JSON, HeadMask

    if (
        not path
        or Path(path).suffix == ".tsv"
        or (Path(path).is_dir() and not (Path(path) / MASK_JSON).is_file())
    ):
        return None
    return HeadMask.from_pretrained(path)
