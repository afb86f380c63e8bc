"""`rlkv ablation-mask --model PATH --problems SET --num N --out DIR`: the ablation head mask (rlkv.ablation)."""

from __future__ import annotations

import argparse
from typing import Any

from rlkv.cli import csv_list, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `ablation-mask` subcommand."""
    parser = subparsers.add_parser(
        "ablation-mask",
        help="score each KV head by the NLL increase when it alone is compressed; write a head mask",
        description="Generate the model's greedy solutions of a problem set (full KV), then for every KV head "
        "set its gate to 0 (sink + local attention) and measure the teacher-forced NLL (nats/token) of the "
        "solutions; the increase is the head's score. Writes OUT/head_mask.json, .tsv and a card "
        "(HeadMask.save_pretrained; metadata method 'ablation' with the raw increases).",
    )
    add_solution_args(parser)
    parser.add_argument("--out", required=True, help="mask folder to write")
    parser.add_argument(
        "--base-model",
        default=None,
        help="the base model's Hub id (e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct) when --model is a local copy: "
        "recorded in the mask's metadata and named as the card's base_model",
    )
    parser.add_argument("--no-progress", action="store_true")
    parser.set_defaults(func=run)


def add_solution_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The model, problem-set and sink / local flags of commands that score heads on greedy solutions
    (`required=False`: --model and --problems may come from elsewhere; the command checks)."""
    parser.add_argument("--model", required=required, help="model path / hub id, or tiny:<family>")
    parser.add_argument("--problems", required=required, help="problem set (rlkv.data name or file)")
    parser.add_argument("--split", default=None, help="dataset split (default: the set's own)")
    parser.add_argument("--num", type=positive_int, default=32, help="problems (seeded sample; default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--exclude-problems",
        dest="exclude_problems",
        type=csv_list,
        default=[],
        help="comma-separated problem sets whose texts to leave out (e.g. the training curriculum: held out)",
    )
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=positive_int, default=512)
    parser.add_argument("--batch-size", dest="batch_size", type=positive_int, default=4)
    parser.add_argument(
        "--sink",
        type=int,
        default=None,
        help="compressed head's sink tokens (default 16; with mask-nll --solutions-from, the eval recipe's sink)",
    )
    parser.add_argument(
        "--local",
        type=positive_int,
        default=None,
        help="compressed head's local window (default 64; with mask-nll --solutions-from, the recipe's window)",
    )
    parser.add_argument("--template", default="auto", help="prompt template (auto, math, code, plain)")
    parser.add_argument("--dtype", default="auto", help="auto, bfloat16, float16 or float32")
    parser.add_argument("--device", default=None, help="e.g. cuda, cpu")


def load_for_solutions(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    """(problems, model, tokenizer) the `add_solution_args` flags name; bad values are one clear error."""
    from rlkv.data.loaders import load_problems
    from rlkv.inference import load

    sink_local(args)  # checked before the model loads
    excluded = frozenset(text for name in args.exclude_problems for text in load_problems(name)["problem"])
    problems = load_problems(args.problems, split=args.split, num=args.num, seed=args.seed, exclude=excluded)
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    return problems, model, tokenizer


def greedy_solutions_of(args: argparse.Namespace, model: Any, tokenizer: Any, problems: Any) -> list:
    """The model's greedy solutions of `problems` with the `add_solution_args` flags
    (rlkv.ablation.greedy_solutions)."""
    from rlkv.ablation import greedy_solutions

    return greedy_solutions(
        model,
        tokenizer,
        problems,
        args.max_new_tokens,
        template=args.template,
        batch_size=args.batch_size,
        progress=not args.no_progress,
    )


def resumable_scores(
    args: argparse.Namespace, model: Any, sequences: list, **settings: Any
) -> tuple[dict, Any, Any]:
    """(the NLLs a stopped search of the same settings measured, a callback that saves them as they come, the
    partial file) for a head-set search writing `args.out`: they live in `<out>.partial.json` (atomic writes)
    until the mask is written; a partial file of other settings is one clear error."""
    import json
    from pathlib import Path

    from rlkv._io import atomic_write_text
    from rlkv.errors import UserInputError

    partial = Path(f"{args.out}.partial.json")
    identity = {
        "mask": args.mask,
        "problems": args.problems,
        "num": args.num,
        "seed": args.seed,
        "max_new_tokens": args.max_new_tokens,
        **settings,
        "dtype": str(next(model.parameters()).dtype),
        "batch_size": args.batch_size,
        "num_tokens": sum(len(c) for _, c in sequences),
    }
    scored = {}
    if partial.exists():
        saved = json.loads(partial.read_text())
        if saved.get("identity") != identity:
            raise UserInputError(
                f"{partial}: a stopped search with other settings ({saved.get('identity')}); delete it to start afresh"
            )
        scored = saved["scored"]
        print(f"resuming from {partial}: {len(scored)} NLLs already measured")

    def save(values: dict[str, float]) -> None:
        atomic_write_text(partial, json.dumps({"identity": identity, "scored": values}, indent=0))

    return scored, save, partial


def sink_local(args: argparse.Namespace, default: tuple[int, int] = (16, 64)) -> tuple[int, int]:
    """(sink, local) of the compressed heads: the flags where given, else `default`; a bad value is one error."""
    from rlkv.errors import UserInputError

    sink = default[0] if args.sink is None else args.sink
    if sink < 0:
        raise UserInputError(f"--sink {sink}: must be >= 0")
    return sink, default[1] if args.local is None else args.local


def run(args: argparse.Namespace) -> int:
    """Score the heads and write the mask folder; prints a summary. Returns the exit status."""
    import time

    from rlkv._io import check_output_path
    from rlkv.ablation import ablation_mask
    from rlkv.errors import UserInputError

    check_output_path(args.out, what="mask folder (--out)", error=UserInputError)  # before hours of scoring
    problems, model, tokenizer = load_for_solutions(args)
    sink, local = sink_local(args)
    began = time.perf_counter()
    mask = ablation_mask(
        model,
        tokenizer,
        problems,
        max_new_tokens=args.max_new_tokens,
        sink=sink,
        local=local,
        batch_size=args.batch_size,
        template=args.template,
        progress=not args.no_progress,
        problem_set=args.problems,
        split=args.split,
        num_problems=len(problems),
        seed=args.seed,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
    )
    mask.metadata["seconds"] = round(time.perf_counter() - began, 1)
    if args.base_model:
        mask.metadata["base_model"] = args.base_model
    mask.save_pretrained(args.out)
    delta = mask.metadata["delta_nll"]
    flat = sorted((v, layer, head) for layer, row in enumerate(delta) for head, v in enumerate(row))
    top = ", ".join(f"L{layer}H{head} +{v:.4f}" for v, layer, head in reversed(flat[-3:]))
    print(
        f"wrote {args.out}: {mask.num_layers} layers x {mask.num_kv_heads} KV heads, base NLL "
        f"{mask.metadata['base_nll']:.4f} nats/token over {mask.metadata['num_tokens']} tokens; "
        f"top heads {top}; {mask.metadata['seconds']} s"
    )
    return 0
