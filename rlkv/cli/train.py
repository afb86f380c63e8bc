"""`rlkv train --config recipes/<name>.yaml [--field value ...]`: train head gates with GRPO.

The arguments after `train` go to the recipe parser of `rlkv.trainers.script` unchanged (the same
as `train_gates.py`, which `accelerate launch` runs for several processes).
"""

from __future__ import annotations


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train head gates with GRPO from a recipe: --config RECIPE.yaml [--field value ...]",
        description="Train RLKV head gates (the same as train_gates.py); every recipe field can be given "
        "as --field value. `rlkv train --help` lists them.",
        add_help=False,
    )
    parser.set_defaults(func=run, passes_extra_args=True)


def run(args) -> int:
    from rlkv.trainers.script import train

    train(args.extra_args or ["--help"], prog="rlkv train")
    return 0
