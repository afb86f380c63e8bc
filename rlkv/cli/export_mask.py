"""`rlkv export-mask CHECKPOINT --out FILE`: write the head mask of a gate-training checkpoint."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `export-mask` subcommand."""
    parser = subparsers.add_parser(
        "export-mask",
        help="export head_mask.json from a train_gates.py checkpoint",
        description="Read gates.safetensors + config.json of a GateGRPOTrainer checkpoint (output_dir/checkpoint-N "
        "or output_dir) and write the HeadMask JSON (and optionally the official TSV).",
    )
    parser.add_argument("checkpoint", help="checkpoint directory holding gates.safetensors and config.json")
    parser.add_argument("--out", required=True, help="head-mask JSON file to write")
    parser.add_argument(
        "--tsv", default=None, help="also write the official TSV (L rows x H_kv columns) here"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; prints a one-line summary. Returns the exit status."""
    import sys

    from rlkv.head_mask import HeadMaskError
    from rlkv.trainers.checkpoints import head_mask_from_checkpoint

    try:
        mask = head_mask_from_checkpoint(args.checkpoint)
    except (FileNotFoundError, OSError, HeadMaskError) as e:
        print(f"rlkv export-mask: error: {e}", file=sys.stderr)
        return 2
    mask.save(args.out)
    if args.tsv:
        mask.to_tsv(args.tsv)
    print(
        f"wrote {args.out}: {mask.num_layers} layers x {mask.num_kv_heads} KV heads of "
        f"{mask.fingerprint.name_or_path or mask.fingerprint.model_type}, "
        f"gates mean {float(mask.scores.mean()):.3f}, {int((mask.scores > 0.5).sum())} above 0.5"
    )
    return 0
