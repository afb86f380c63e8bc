"""`rlkv export-mask CHECKPOINT --out FILE | --folder DIR`: the head mask of a gate-training checkpoint,
as one JSON file or as a release folder with its card, training curves and heatmap (`rlkv.eval.release`)."""

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
    parser.add_argument("--out", default=None, help="head-mask JSON file to write")
    parser.add_argument(
        "--folder",
        default=None,
        help="write a release folder instead: mask, TSV, card with the training run, curves and gate heatmap",
    )
    parser.add_argument(
        "--recipe",
        action="append",
        default=None,
        help="with --folder: the training recipe, quoted in the card; repeat it, in order, for a run continued "
        "under several recipes (each later one's resume_from_checkpoint names where it picked up)",
    )
    parser.add_argument(
        "--eval-table", default=None, help="with --folder: a markdown eval table appended to the card"
    )
    parser.add_argument(
        "--tsv", default=None, help="also write the official TSV (L rows x H_kv columns) here"
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="the base model's Hub id (e.g. Qwen/Qwen2.5-Coder-0.5B-Instruct) when training loaded a local copy: "
        "recorded in the mask's metadata and named as the card's base_model",
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export; prints a one-line summary. Returns the exit status."""
    import sys

    from rlkv.errors import UserInputError
    from rlkv.head_mask import HeadMaskError
    from rlkv.trainers.checkpoints import head_mask_from_checkpoint

    if (args.out is None) == (args.folder is None):
        print("rlkv export-mask: error: give exactly one of --out FILE or --folder DIR", file=sys.stderr)
        return 2
    try:
        if args.folder is not None:
            from rlkv.eval.release import write_mask_release

            mask = write_mask_release(
                args.checkpoint, args.folder, args.recipe, args.eval_table, base_model=args.base_model
            )
        else:
            mask = head_mask_from_checkpoint(args.checkpoint)
            if args.base_model:
                mask.metadata["base_model"] = args.base_model
            mask.save(args.out)
    except (FileNotFoundError, OSError, HeadMaskError, UserInputError) as e:
        print(f"rlkv export-mask: error: {e}", file=sys.stderr)
        return 2
    if args.tsv:
        mask.to_tsv(args.tsv)
    print(
        f"wrote {args.out or args.folder}: {mask.num_layers} layers x {mask.num_kv_heads} KV heads of "
        f"{mask.fingerprint.name_or_path or mask.fingerprint.model_type}, "
        f"gates mean {float(mask.scores.mean()):.3f}, {int((mask.scores > 0.5).sum())} above 0.5"
    )
    return 0
