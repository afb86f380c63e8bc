"""`rlkv data ...`: build the self-distilled length curriculum, or show problems of a dataset as prompts."""

from __future__ import annotations

import argparse
import json
import sys

from rlkv.cli import add_vllm_arg, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `rlkv data curriculum` and `rlkv data show`."""
    from rlkv.data.curriculum import KEEP_CHOICES, PAPER_BUCKETS

    data = subparsers.add_parser("data", help="problem datasets and the length curriculum")
    sub = data.add_subparsers(dest="data_command", required=True)

    cur = sub.add_parser(
        "curriculum",
        help="greedy-solve a problem pool, keep solved (or finished) problems, bucket by solution length, "
        "sample quotas",
        description="Self-distilled length curriculum (RLKV). Resumable: rerun the same command after a kill.",
    )
    cur.add_argument(
        "--model", required=True, help="local path, hub id, or tiny:<family> (random test model)"
    )
    cur.add_argument(
        "--problems", required=True, help="dataset name (rlkv.data.problem_sources()) or a schema file"
    )
    cur.add_argument("--out", required=True, help="output folder (dataset/, stats.json, shards/)")
    cur.add_argument("--split", default=None, help="dataset split (default: the dataset's own)")
    cur.add_argument(
        "--num",
        type=positive_int,
        default=None,
        help="pool size: seeded sample of the dataset (default: all)",
    )
    cur.add_argument(
        "--data-files", default=None, help="read a named dataset from this local file (hub layout)"
    )
    cur.add_argument("--buckets", default=PAPER_BUCKETS, help="LOW-HIGH:QUOTA,... in tokens, k = 1024")
    cur.add_argument("--engine", choices=("transformers", "vllm"), default="transformers")
    cur.add_argument(
        "--max-new-tokens", type=positive_int, default=None, help="default: the top bucket's upper bound"
    )
    cur.add_argument("--batch-size", type=positive_int, default=8, help="transformers engine batch size")
    cur.add_argument(
        "--chunk-size", type=positive_int, default=None, help="problems per engine call / resume unit"
    )
    cur.add_argument("--seed", type=int, default=0, help="pool sampling and quota sampling seed")
    cur.add_argument(
        "--keep",
        choices=KEEP_CHOICES,
        default="solved",
        help="sample quotas from solved problems (the paper's curriculum), from every finished "
        "completion, correct or not (a distillation set: the full model's own behaviour is the target), or "
        "from all, cut ones included (an on-policy set of a compressed model, --head-mask, keeps its loops)",
    )
    cur.add_argument("--template", default="auto", help="prompt template: auto, math, code, plain")
    cur.add_argument(
        "--open-think", action="store_true", help="start the answer inside an opened <think> block"
    )
    cur.add_argument(
        "--dtype",
        default="auto",
        help="model dtype on either engine: auto (bf16 where the machine computes it natively, else fp32), "
        "bfloat16, float16 or float32",
    )
    add_vllm_arg(cur)
    cur.add_argument("--device", default=None, help="device for the transformers engine (e.g. cuda)")
    cur.add_argument(
        "--head-mask",
        default=None,
        help="generate with this head mask's compressed KV cache (rlkv eval's 'rlkv' method: sink + local "
        "on the compressed heads; on --engine vllm a window of the same 80 tokens, no sink) instead of the "
        "full one: an on-policy distillation set",
    )
    cur.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="with --head-mask: fraction of KV heads compressed, in [0, 1]",
    )
    cur.set_defaults(func=_curriculum)

    show = sub.add_parser("show", help="print problems of a dataset with the prompt the model would see")
    show.add_argument("problems", help="dataset name or schema file")
    show.add_argument("--split", default=None)
    show.add_argument("--num", type=int, default=3)
    show.add_argument("--seed", type=int, default=0)
    show.add_argument("--data-files", default=None)
    show.add_argument("--template", default="auto")
    show.set_defaults(func=_show)


def _curriculum(args: argparse.Namespace) -> int:
    from rlkv.data.curriculum import CurriculumError

    try:
        result = _build(args)
    except (CurriculumError, ValueError) as e:  # bad data, buckets or settings, or nothing solved
        print(f"rlkv data curriculum: error: {e}", file=sys.stderr)
        return 2
    stats = result.stats
    print(
        f"solved {stats['solved']}/{stats['pool_size']} ({stats['pool_accuracy']:.1%}), kept {stats['kept']} "
        f"({stats['keep']}); "
        f"selected {stats['selected']} -> {result.out_dir / 'dataset'}"
    )
    for b in stats["buckets"]:
        short = f" (short by {b['shortfall']})" if b["shortfall"] else ""
        print(f"  {b['bucket']:>10}: {b['selected']}/{b['quota']} of {b['available']} {stats['keep']}{short}")
    tput = stats["throughput"]
    if tput["problems_generated"]:
        print(f"throughput: {tput['problems_per_s']} problems/s, {tput['tokens_per_s']} tokens/s")
    return 0


def _build(args: argparse.Namespace):
    from rlkv._io import check_output_path
    from rlkv.data.curriculum import CurriculumConfig, build_curriculum
    from rlkv.data.loaders import load_problems
    from rlkv.errors import UserInputError
    from rlkv.rollout.engines import make_engine

    check_output_path(args.out, what="curriculum folder (--out)", error=UserInputError)
    if args.vllm_args and args.engine != "vllm":
        raise UserInputError(
            "--vllm-arg without --engine vllm: the transformers engine takes no vLLM arguments"
        )
    if args.engine == "vllm":
        import importlib.util

        from rlkv.inference.vllm_engine import VLLM_INSTALL, check_vllm_model

        check_vllm_model(args.model)
        if importlib.util.find_spec("vllm") is None:
            raise UserInputError(f"--engine vllm needs vLLM: {VLLM_INSTALL}")
    problems = load_problems(
        args.problems, split=args.split, num=args.num, seed=args.seed, data_files=args.data_files
    )
    chunk_size = args.chunk_size
    if chunk_size is None:
        chunk_size = args.batch_size * 8 if args.engine == "transformers" else 512
    config = CurriculumConfig(
        buckets=args.buckets,
        max_new_tokens=args.max_new_tokens,
        template=args.template,
        open_think=args.open_think,
        chunk_size=chunk_size,
        seed=args.seed,
        keep=args.keep,
    )
    compression = _mask_compression(args)
    if args.engine == "transformers":
        engine = make_engine(
            "transformers",
            args.model,
            batch_size=args.batch_size,
            dtype=args.dtype,
            device=args.device,
            compression=compression,
        )
    else:
        engine = make_engine(
            "vllm",
            args.model,
            seed=args.seed,
            dtype=args.dtype,
            compression=compression,
            **dict(args.vllm_args),
        )
    return build_curriculum(engine, problems, args.out, config)


def _mask_compression(args: argparse.Namespace):
    """The CompressionConfig of --head-mask / --sparsity (rlkv eval's 'rlkv' method), or None."""
    from rlkv.errors import UserInputError
    from rlkv.eval.methods import BudgetRule
    from rlkv.inference.config import CompressionConfig

    if args.head_mask is None:
        if args.sparsity is not None:
            raise UserInputError("--sparsity is only used with --head-mask; add --head-mask MASK or drop it")
        return None
    if args.sparsity is None:
        raise UserInputError("--head-mask needs --sparsity (the fraction of KV heads compressed, e.g. 0.75)")
    rule = BudgetRule()  # the eval's form on either engine: sink + window after a full prompt forward
    return CompressionConfig(
        head_mask=args.head_mask,
        sparsity=args.sparsity,
        sink=rule.sink,
        window=rule.window,
        protect_prompt=rule.protect_prompt,
    )


def _show(args: argparse.Namespace) -> int:
    from rlkv.data.loaders import load_problems
    from rlkv.data.prompts import format_problem

    problems = load_problems(
        args.problems, split=args.split, num=args.num, seed=args.seed, data_files=args.data_files
    )
    for row in problems:
        meta = json.loads(row["metadata"]) if row.get("metadata") else {}
        print(f"--- source={row['source']} answer={row['answer']!r} metadata keys={sorted(meta)}")
        print(format_problem(row, args.template))
    return 0
