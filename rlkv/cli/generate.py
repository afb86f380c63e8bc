"""`rlkv generate --model PATH [--head-mask FILE --sparsity S --policy NAME --budget N] --prompt TEXT`."""

from __future__ import annotations

import argparse

from rlkv.cli import budget_value, json_object, positive_int


def _positive_float(text: str) -> float:
    """argparse type: a float > 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(
            f"{text} must be > 0 (greedy decoding is the default without --sample)"
        )
    return value


def _top_p(text: str) -> float:
    """argparse type: a float in (0, 1]."""
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} must be in (0, 1]")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser(
        "generate",
        help="generate with a head-mixed compressed KV cache",
        description="Load a model (and optionally a head mask), generate for each --prompt, print the text and "
        "the cache statistics. Without --head-mask every head runs the policy (baseline mode); with "
        "--no-compression the plain full cache is used.",
    )
    parser.add_argument(
        "--model", required=True, help="model path or hub id; 'tiny:llama' etc. for a random tiny model"
    )
    parser.add_argument(
        "--head-mask",
        default=None,
        help="head mask: a mask folder or hub id, head_mask.json, an RLKV-authors adapter_weights.tsv, "
        "or a DuoAttention folder (anything HeadMask.from_pretrained reads)",
    )
    parser.add_argument(
        "--sparsity",
        type=float,
        default=None,
        help="fraction of KV heads the --head-mask compresses (default 0.5); needs --head-mask",
    )
    parser.add_argument(
        "--policy", default="streaming", help="policy of the compressed heads (default streaming)"
    )
    parser.add_argument(
        "--policy-kwargs", type=json_object, default={}, help="JSON object of policy arguments"
    )
    parser.add_argument(
        "--budget", type=budget_value, default=None, help="tokens (int) or ratio of the length (float)"
    )
    parser.add_argument("--sink", type=int, default=16)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--no-protect-prompt", action="store_true", help="let the policy evict prompt tokens")
    parser.add_argument("--no-compression", action="store_true", help="plain full KV cache (reference run)")
    parser.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    parser.add_argument("--max-new-tokens", type=positive_int, default=256)
    parser.add_argument("--batch-size", type=positive_int, default=8)
    parser.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    parser.add_argument("--temperature", type=_positive_float, default=1.0, help="> 0 (with --sample)")
    parser.add_argument("--top-p", type=_top_p, default=1.0, help="in (0, 1] (with --sample)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-chat-template", action="store_true", help="tokenize the prompts as raw text")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"))
    parser.add_argument(
        "--device", default=None, help="e.g. cuda, cpu (default: where from_pretrained puts it)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument(
        "--no-static-cache",
        action="store_true",
        help="on CUDA, decode with the dynamic cache instead of the static, compiled one (CUDA graphs)",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Generate and print; invalid input raises the project's errors (one `error:` line from `rlkv.cli.main`)."""
    import dataclasses
    import json

    from rlkv.errors import UserInputError
    from rlkv.inference import CompressionConfig, generate, load

    for i, prompt in enumerate(args.prompt):
        if not prompt.strip():
            raise UserInputError(f"--prompt {i + 1} is empty: give the text the model should answer")
        try:  # argv bytes that are not UTF-8 arrive as lone surrogates, which tokenizers reject with a TypeError
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:
            raise UserInputError(
                f"--prompt {i + 1} is not UTF-8 text (bad byte at {e.start}); pass UTF-8"
            ) from None
    policy_kwargs = args.policy_kwargs
    if args.sparsity is not None and (args.head_mask is None or args.no_compression):
        raise UserInputError(
            "--sparsity needs --head-mask (and compression): without a mask the policy compresses every head"
        )
    compression = None
    if not args.no_compression:
        compression = CompressionConfig(
            head_mask=args.head_mask,
            **({} if args.sparsity is None else {"sparsity": args.sparsity}),
            policy=args.policy,
            policy_kwargs=policy_kwargs,
            budget=args.budget,
            sink=args.sink,
            window=args.window,
            protect_prompt=not args.no_protect_prompt,
        )
    model, tokenizer = load(args.model, compression=compression, dtype=args.dtype, device=args.device)
    outputs = generate(
        model,
        tokenizer,
        args.prompt,
        args.max_new_tokens,
        batch_size=args.batch_size,
        do_sample=args.sample,
        temperature=args.temperature,
        top_p=args.top_p,
        apply_chat_template=not args.no_chat_template,
        progress=False,
        seed=args.seed,
        static_cache=False if args.no_static_cache else None,
    )
    for i, out in enumerate(outputs):
        if args.json:
            print(json.dumps(dataclasses.asdict(out)))
            continue
        stats = out.cache_stats
        ratio = stats["resident_bytes"] / max(stats["full_resident_bytes"], 1)
        print(
            f"=== prompt {i}: {out.num_prompt_tokens} prompt + {out.num_generated_tokens} generated "
            f"({out.finish_reason})"
        )
        print(out.text)
        print(
            f"--- cache: {stats['resident_bytes']} bytes resident "
            f"({ratio:.1%} of full {stats['full_resident_bytes']}), "
            f"logical length {stats['logical_length']}, kept {stats['kept_tokens']} KV entries, "
            f"{stats['evictions']} evicted"
        )
    return 0
