"""`rlkv steering compute`: a SkipKV steering vector from reasoning traces (execution minus non-execution)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `steering` subcommand (with its `compute` action)."""
    parser = subparsers.add_parser("steering", help="SkipKV steering vectors")
    actions = parser.add_subparsers(dest="steering_command", required=True)
    compute = actions.add_parser(
        "compute",
        help="compute a steering vector from reasoning traces",
        description="Run MODEL over the traces in DATA (JSONL, one object per line), split them into sentences at "
        "newline delimiters, and write mean(H_exec) - mean(H_nonexec) at the output of decoder layer LAYER "
        "(non-execution sentences contain 'Wait', 'Alternatively' or 'again'). Use it with "
        'CompressionConfig(policy="skipkv", policy_kwargs={"tokenizer": ..., "steering": OUT}).',
    )
    compute.add_argument(
        "--model", required=True, help="model path or hub id (loaded with rlkv.inference.load)"
    )
    compute.add_argument("--data", required=True, help="JSONL file of traces, e.g. the model's own responses")
    compute.add_argument("--field", default="text", help="JSON field holding the trace text (default: text)")
    compute.add_argument(
        "--layer", type=int, required=True, help="decoder layer index, 0-based (paper: 20 of 28)"
    )
    compute.add_argument("--out", required=True, help="steering-vector JSON to write")
    compute.add_argument("--limit", type=int, default=None, help="use only the first N traces (paper: 1000)")
    compute.add_argument(
        "--max-length", type=int, default=None, help="truncate each trace to this many tokens"
    )
    compute.add_argument("--dtype", default="auto", help="model dtype (auto, float32, bfloat16, ...)")
    compute.add_argument("--device", default=None, help="device, e.g. cuda (default: where the model loads)")
    compute.set_defaults(func=run_compute)


def _read_traces(path: str, field: str, limit: int | None) -> list[str]:
    import json

    texts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise ValueError(
                    f"{path}:{number}: expected a JSON object with a string field {field!r} (--field)"
                )
            texts.append(record[field])
            if limit is not None and len(texts) >= limit:
                break
    return texts


def run_compute(args: argparse.Namespace) -> int:
    """Compute and save; prints a one-line summary. Returns the exit status."""
    import sys

    from rlkv.inference import load
    from rlkv.policies.helpers.steering import SteeringError, compute_steering_vector

    try:
        texts = _read_traces(args.data, args.field, args.limit)
        model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
        vector = compute_steering_vector(model, tokenizer, texts, args.layer, max_length=args.max_length)
    except (OSError, ValueError, SteeringError) as e:
        print(f"rlkv steering compute: error: {e}", file=sys.stderr)
        return 2
    vector.save(args.out)
    print(
        f"wrote {args.out}: layer {vector.layer}, hidden {vector.vector.numel()}, "
        f"norm {float(vector.vector.norm()):.4g}, "
        f"from {vector.num_execution} execution and {vector.num_non_execution} non-execution sentences "
        f"of {len(texts)} traces"
    )
    return 0
