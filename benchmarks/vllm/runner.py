"""vLLM benchmark: stock vLLM vs rlkv's head mask on stock vLLM, at a fixed KV cache size, in one run.

    .venv-vllm/bin/python -m benchmarks --suite vllm                    # synthetic model, CPU, ~10 min
    .venv-vllm/bin/python -m benchmarks --suite vllm --vllm-model models/qwen2.5-coder-0.5b-instruct
    .venv-vllm/bin/python -m benchmarks --suite vllm --quick            # a smoke run

Every request is a prompt of --vllm-prompt random tokens and --vllm-new-tokens generated tokens with EOS
ignored. Two KV cache sizes (`kv_cache_memory_bytes`): "memory-bound", where stock vLLM holds
--vllm-bound-rows requests at once (the rest wait or are preempted), and "unbound", where every request
fits at once. In each, the engines run the same requests one after the other: stock vLLM, then the head
split of a random mask at s=0.5 and s=0.75 (window --vllm-window; which heads are full does not change the
speed). The engine is stepped by hand so that every step reads vLLM's own block pool and scheduler:
tokens/s (generated tokens over the whole run, prefill included), requests finished per minute, peak
blocks in use, peak requests running, preemptions (summed over requests).
The compressed heads' form: --vllm-form (default eval: sink 16 + window after a full prompt forward).
For reference, plain transformers `generate` and rlkv's transformers path (the same form) run the
same prompts as one batch. The synthetic model has Qwen2.5-0.5B's attention geometry (14 query heads, 2 KV
heads, head_dim 64, hidden 896) with --vllm-layers layers and random weights (fp32).

Targets (issue 65): memory-bound, rlkv s=0.5 >= 1.5x stock's decode tokens/s and s=0.75 >= 2.0x; unbound,
rlkv >= 0.95x stock.

--vllm-methods adds token eviction on vLLM (issue 76), each in the eval's own `CompressionConfig`
(`rlkv.eval.methods.method_config`, matched budgets: buffer 0, the prompt evictable): `rlkv+rkv` (R-KV on
the mask's compressed heads, budget 80 with sink 16 + window 8) and `rkv` (R-KV on every head at its
matched ratio budget); each row reports the compactions per request. Targets: memory-bound, rlkv+rkv
s=0.75 >= 2.0x stock and rkv s=0.5 >= 1.5x; unbound >= 0.9x. --vllm-policy-kwargs '{"buffer": 128}' measures
R-KV's serving setting instead (a compaction every 128 generated tokens; 128 more slots per request).
A method runs at s=0.5 and 0.75, or at one sparsity as METHOD@S (`--vllm-methods rlkv+rkv@0.75,rkv@0.5`:
the cells that carry the memory-bound targets); --vllm-kv bound (or unbound) runs one KV size only, for a
long run at reasoning length.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.vllm import dispatch, engines, padding
from benchmarks.vllm.llm import bench_llm
from rlkv.cli import json_object

TARGETS = {("bound", 0.5): 1.5, ("bound", 0.75): 2.0, ("unbound", 0.5): 0.95, ("unbound", 0.75): 0.95}
# token eviction (--vllm-methods): (method, KV size, sparsity) -> the ratio to stock vLLM's tokens/s
EVICTION_TARGETS = {
    ("rlkv+rkv", "bound", 0.75): 2.0,
    ("rkv", "bound", 0.5): 1.5,
    ("rlkv+rkv", "unbound", 0.5): 0.9,
    ("rlkv+rkv", "unbound", 0.75): 0.9,
    ("rkv", "unbound", 0.5): 0.9,
    ("rkv", "unbound", 0.75): 0.9,
}
SPARSITIES = (0.5, 0.75)
# --vllm-form: `rlkv.inference.vllm.vllm_compression` keywords (besides the window)
FORMS = {
    "eval": {"sink": 16},
    "protected": {"sink": 16, "protect_prompt": True},
    "window-only": {"sink": 0, "window_prefill": True},
}


def add_options(parser: argparse.ArgumentParser) -> None:
    """The vLLM suite's options."""
    parser.add_argument("--vllm-model", default="synthetic", help="model folder, or synthetic (default)")
    parser.add_argument("--vllm-layers", type=int, default=6, help="layers of the synthetic model")
    parser.add_argument("--vllm-prompt", type=int, default=512, help="prompt tokens per request")
    parser.add_argument("--vllm-new-tokens", type=int, default=2048, help="generated tokens per request")
    parser.add_argument("--vllm-requests", type=int, default=12, help="requests per engine run")
    parser.add_argument(
        "--vllm-bound-rows", type=int, default=3, help="requests stock vLLM holds at once when memory-bound"
    )
    parser.add_argument("--vllm-window", type=int, default=64, help="window of the compressed heads")
    parser.add_argument(
        "--vllm-form",
        choices=sorted(FORMS),
        default="eval",
        help="the compressed heads' form: eval (sink 16 + window after a full prompt, the default), protected "
        "(the prompt kept whole too) or window-only (vLLM's sliding window, sink 0)",
    )
    parser.add_argument(
        "--vllm-methods",
        default="rlkv",
        help="comma-separated: rlkv (the head mask in --vllm-form), rlkv+rkv and/or rkv (token eviction on "
        "vLLM, the eval's matched configs), each at s=0.5 and 0.75, or at one sparsity as METHOD@S (rkv@0.5)",
    )
    parser.add_argument(
        "--vllm-kv",
        choices=("both", "bound", "unbound"),
        default="both",
        help="the KV cache sizes to run (serving part): both (default), bound or unbound",
    )
    parser.add_argument(
        "--vllm-policy-kwargs",
        type=json_object,
        default={},
        help="constructor arguments of the eviction policy for --vllm-methods rlkv+rkv / rkv, over the "
        "matched defaults (e.g. '{\"buffer\": 128}', R-KV's serving setting: a compaction every 128 tokens)",
    )
    parser.add_argument(
        "--vllm-parts",
        default="serving,engines",
        help="serving (stock vLLM vs rlkv at a fixed KV size), engines (vLLM as rlkv's eval and GRPO "
        "rollout engine, benchmarks/vllm/engines.py; needs --vllm-model) and/or padding (vLLM's KV capacity "
        "for the authors' masks against the ideal, benchmarks/vllm/padding.py; needs --vllm-author-masks) and/or "
        "dispatch (torch ops per decode step against stock vLLM, benchmarks/vllm/dispatch.py)",
    )
    parser.add_argument(
        "--vllm-kernel",
        choices=("stock", "torch", "both"),
        default="stock",
        help="the compressed heads' kernel (serving part): stock (the platform's own, the default), torch (rlkv's "
        "reference forms) or both (each method twice, the torch rows marked [torch] and left out of the checks)",
    )
    parser.add_argument(
        "--vllm-no-references",
        action="store_true",
        help="skip the transformers reference rows of the serving part (one batch each: long at 2K tokens)",
    )
    parser.add_argument(
        "--vllm-author-masks", default=None, help="a clone of the RLKV authors' repository (the padding part)"
    )
    engines.add_options(parser)


def method_cells(spec: str) -> list[tuple[str, float]]:
    """--vllm-methods as (method, sparsity) cells in order: METHOD runs at every sparsity of SPARSITIES,
    METHOD@S at S only."""
    cells = []
    for item in spec.split(","):
        method, _, sparsity = item.strip().partition("@")
        if method not in {"rlkv", "rlkv+rkv", "rkv"}:
            raise SystemExit(
                f"--vllm-methods {method!r}: choose rlkv, rlkv+rkv and/or rkv (METHOD or METHOD@S)"
            )
        try:
            values = (float(sparsity),) if sparsity else SPARSITIES
        except ValueError:
            raise SystemExit(
                f"--vllm-methods {item!r}: the sparsity after @ is a number, e.g. rkv@0.5"
            ) from None
        if not all(0 < v < 1 for v in values):
            raise SystemExit(
                f"--vllm-methods {item!r}: the sparsity after @ is between 0 and 1, e.g. rkv@0.5"
            )
        cells += [(method, v) for v in values if (method, v) not in cells]
    return cells


def synthetic_model(folder: Path, layers: int) -> Path:
    """A random Qwen2 with Qwen2.5-0.5B's attention geometry, saved as a model folder (no tokenizer)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=1024,
        hidden_size=896,
        intermediate_size=2432,
        num_hidden_layers=layers,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def _kv_bytes_per_token(config) -> int:
    from rlkv.geometry import attention_geometry

    g = attention_geometry(config)
    return g.num_hidden_layers * g.num_key_value_heads * g.head_dim * 2 * 4  # K and V, fp32


def run_engine(
    model: str, prompts: list[list[int]], new_tokens: int, kv_bytes: int, overrides: dict | None
) -> dict:
    """One engine over every request, stepped by hand; what vLLM's scheduler and block pool held."""
    import vllm

    llm = bench_llm(model, len(prompts[0]) + new_tokens, kv_bytes, overrides)
    from rlkv.vllm_plugin.fence import eviction_compactions

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler  # private engine state, read only
    pool = scheduler.kv_cache_manager.block_pool
    params = vllm.SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    total_blocks = pool.num_gpu_blocks - 1  # block 0 is vLLM's null block
    started = time.perf_counter()
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    peak_used = peak_running = generated = 0
    preemptions: dict[str, int] = {}
    finished_at = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
                finished_at.append(time.perf_counter() - started)
        peak_used = max(peak_used, total_blocks - pool.get_num_free_blocks())
        peak_running = max(peak_running, len(scheduler.running))
        for request in scheduler.requests.values():  # every live request: its own preemption count
            preemptions[request.request_id] = request.num_preemptions
    wall = time.perf_counter() - started
    groups = len(scheduler.kv_cache_config.kv_cache_groups)
    compactions = eviction_compactions(llm) or [0]
    engine.engine_core.shutdown()
    del llm, engine, scheduler, pool
    gc.collect()
    return {
        "wall_s": wall,
        "tokens_per_s": generated / wall,
        "requests_per_min": 60 * len(finished_at) / wall,
        "peak_blocks_used": peak_used,
        "blocks": total_blocks,
        "peak_running": peak_running,
        "preemptions": sum(preemptions.values()),
        "kv_cache_groups": groups,
        "generated": generated,
        "compactions_per_request": max(compactions) / len(prompts),  # each group compacts every request alike
    }


def run_transformers(model_path: str, prompts: list[list[int]], new_tokens: int, compression) -> dict:
    """Plain transformers `generate` (compression None) or rlkv's cache, all prompts in one batch."""
    from rlkv.compat import cache_kwargs
    from rlkv.inference import load, make_cache

    model, _ = load(model_path, dtype="float32")
    ids = torch.tensor(prompts)
    extra = {} if compression is None else cache_kwargs(make_cache(model, compression))
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
    wall = time.perf_counter() - started
    generated = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"wall_s": wall, "tokens_per_s": generated / wall, "generated": generated}


def suite_vllm(args: argparse.Namespace) -> dict:
    """The parts of --vllm-parts: serving (`suite_serving`) and engines (`engines.suite_engines`)."""
    parts = args.vllm_parts.split(",")
    unknown = sorted(set(parts) - {"serving", "engines", "padding", "dispatch"})
    if unknown:
        raise SystemExit(f"--vllm-parts {unknown}: choose serving, engines, padding and/or dispatch")
    result: dict = {
        "settings": {k: v for k, v in vars(args).items() if k.startswith("vllm_")}
        | {"model": args.vllm_model}
    }
    if "serving" in parts:
        result |= suite_serving(args)
    if "engines" in parts:
        if args.vllm_model == "synthetic" and not args.quick:
            raise SystemExit(
                "--vllm-parts engines needs a real model: --vllm-model models/qwen2.5-coder-0.5b-instruct"
            )
        model = args.vllm_model if args.vllm_model != "synthetic" else "assets/demo-model"
        args.vllm_model = result["settings"]["model"] = model
        result["engines"] = engines.suite_engines(args, Path(args.out))
    if "padding" in parts:
        result |= padding.suite_padding(args)
    if "dispatch" in parts:
        result |= dispatch.suite_dispatch(args)
    checks = result.get("checks", []) + result.get("engines", {}).get("checks", [])
    checks += result.get("padding", {}).get("checks", []) + result.get("dispatch", {}).get("checks", [])
    result["passed"] = all(c["pass"] for c in checks)
    return result


def _with_kernel(model: str, config: Any, kernel: str) -> dict:
    """vLLM overrides of `config` on `model` with the compressed heads on `kernel` (`HeadSplit.kernel`)."""
    from rlkv.inference.vllm import compression_overrides
    from rlkv.vllm_plugin.split import CONFIG_KEY

    overrides = compression_overrides(model, config)
    return overrides | {CONFIG_KEY: overrides[CONFIG_KEY] | {"kernel": kernel}}


def suite_serving(args: argparse.Namespace) -> dict:
    """Both KV sizes, stock and rlkv at each sparsity, plus the transformers reference rows."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from rlkv import HeadMask
    from rlkv.eval.methods import method_config
    from rlkv.inference import load
    from rlkv.inference.vllm import vllm_compression

    if args.quick:
        args.vllm_layers, args.vllm_prompt, args.vllm_new_tokens, args.vllm_requests = 2, 64, 96, 4
        args.vllm_bound_rows = 1
    tmp = tempfile.TemporaryDirectory()
    model = args.vllm_model
    if model == "synthetic":
        model = str(synthetic_model(Path(tmp.name) / "synthetic", args.vllm_layers))
    hf, _ = load(model, dtype="float32")
    mask = HeadMask.random(hf, seed=0)
    per_token = _kv_bytes_per_token(hf.config)
    vocab = hf.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, vocab, (args.vllm_requests, args.vllm_prompt), generator=generator).tolist()
    row_tokens = args.vllm_prompt + args.vllm_new_tokens
    row_blocks = -(-row_tokens // 32)
    sizes = {
        # + 1: vLLM's null block
        "bound": (args.vllm_bound_rows * row_blocks + 1) * 32 * per_token,
        "unbound": ((args.vllm_requests + 1) * row_blocks + 1) * 32 * per_token,
    }

    def form(sparsity: float):
        return vllm_compression(mask, sparsity, window=args.vllm_window, **FORMS[args.vllm_form])

    cells = method_cells(args.vllm_methods)
    rlkv_sparsities = [s for m, s in cells if m == "rlkv"]  # rlkv's rows get transformers references

    def config(method: str, sparsity: float):
        if method == "rlkv":
            return form(sparsity)
        kwargs = {"rkv": args.vllm_policy_kwargs}
        return method_config(method, sparsity, model=hf, masks={"rlkv": mask}, policy_kwargs=kwargs)

    kernels = ["stock", "torch"] if args.vllm_kernel == "both" else [args.vllm_kernel]
    runs = [("stock vLLM", 0.0, None)] + [
        (
            f"{m} s={s}" + (" [torch]" if kernel == "torch" else ""),
            s,
            _with_kernel(model, config(m, s), kernel),
        )
        for m, s in cells
        for kernel in kernels
    ]
    if args.vllm_kv != "both":
        sizes = {args.vllm_kv: sizes[args.vllm_kv]}
    hf = None  # the engines load their own copy
    gc.collect()
    rows = []
    for bound, kv_bytes in sizes.items():
        for name, sparsity, overrides in runs:
            print(f"  vllm: {bound} {name} ...", flush=True)
            r = run_engine(model, prompts, args.vllm_new_tokens, kv_bytes, overrides)
            method = name.split(" ")[0] if overrides else "stock"
            method += (
                " [torch]" if name.endswith("[torch]") else ""
            )  # the checks read the stock kernel's rows
            rows.append({"kv": bound, "kv_bytes": kv_bytes, "method": name, "sparsity": sparsity, **r})
            rows[-1]["kind"] = method
            print(f"  vllm: {bound} {name}: {json.dumps(r)}", flush=True)
    references = [] if args.vllm_no_references or not rlkv_sparsities else [0.0, *sorted(rlkv_sparsities)]
    for sparsity in references:
        compression = None if sparsity == 0 else form(sparsity)
        name = "transformers generate" if sparsity == 0 else f"rlkv transformers s={sparsity}"
        r = run_transformers(model, prompts, args.vllm_new_tokens, compression)
        rows.append({"kv": "reference", "method": name, "sparsity": sparsity, **r})
        print(f"  vllm: reference {name}: {json.dumps(r)}", flush=True)
    tmp.cleanup()
    targets = {("rlkv", *key): target for key, target in TARGETS.items()} | EVICTION_TARGETS
    checks = []
    for (method, bound, sparsity), target in targets.items():
        if (method, sparsity) not in cells or bound not in sizes:
            continue
        stock = next(r for r in rows if r["kv"] == bound and r["sparsity"] == 0)
        mixed = next(
            r for r in rows if r["kv"] == bound and r["kind"] == method and r["sparsity"] == sparsity
        )
        ratio = mixed["tokens_per_s"] / stock["tokens_per_s"]
        checks.append(
            {
                "method": method,
                "kv": bound,
                "sparsity": sparsity,
                "ratio": ratio,
                "target": target,
                "pass": ratio >= target,
            }
        )
    return {"rows": rows, "checks": checks}
