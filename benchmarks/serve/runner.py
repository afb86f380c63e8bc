"""Serving benchmark: throughput at a fixed KV memory budget (the batch-scaling result).

    python -m benchmarks --suite serve --model models/qwen2.5-coder-0.5b-instruct --kv-cap-gib 0.25
    python -m benchmarks --suite serve --serve-model synthetic --kv-cap-gib 0.125   # Llama-3.1-8B attention
    python -m benchmarks --suite serve --quick                                      # a smoke run (seconds)
python -m benchmarks --suite serve --device cuda      # GPU: Qwen2.5-7B geometry, cap = 16 full rows, < 8 min

For every method (full; rlkv head mask at s=0.5 and 0.75 with streaming heads; rkv budget 1024 on
every head; rlkv+rkv at s=0.5; any registered policy named in --serve-policies) the suite searches
the largest batch whose resident KV stays under --kv-cap-gib by real runs: it starts at the cap
over an estimate of one row's KV (from the model's geometry and the method's kept tokens) and
gallops and bisects from there, until the batch that fits and the one above it that does not are
both measured (a right guess costs two probes). Finished probes are recorded in
--out/serve_probes.jsonl and reused by a rerun under the same settings (a killed run resumes).
Every probe is one generation of --serve-tokens tokens after the prompt with EOS suppressed
(every row runs to the end), in its own process (clean peak RSS: VmHWM is reset after the model is
loaded; `--device cuda` reads torch.cuda.max_memory_allocated). A probe stops as soon as the
resident KV goes over the cap. The run at the largest fitting batch gives:

- steady-state decode tokens/s (the second half of the decode steps) and whole-run tokens/s
  (prefill included);
- peak resident KV, read from tensor storage after every step (`HeadMixedCache.resident_bytes()`;
  DynamicCache's key/value storages for full) and peak process memory;
- tokens/s / full's tokens/s at the same cap, with PASS/FAIL against the targets below.

On CUDA without --model the suite measures random weights of Qwen2.5-7B's geometry (all 28 layers, bf16,
built on the device once; probes run in that one process and read torch.cuda.max_memory_allocated):
rows of 4096 tokens (a 3584-token random prompt that stands in for generated reasoning, so every
token is evictable, + 512 new tokens), a cap where full fits exactly 16 rows, SDPA without cuDNN for
every method (cuDNN builds a graph per key length), and a --serve-time-limit (420 s) after which the
remaining probes are skipped and reported as such. Target on the GPU: rlkv s=0.5 >= 1.8x full (RLKV's
SGLang runtime measured 1.80x at s=0.5).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable

import torch

from benchmarks.common import child_env, module_command
from benchmarks.serve.probe import (
    Method,
    find_max_batch,
    kv_geometry,
    methods,
    probe_key,
    probe_log,
    protect_prompt,
    recorded_probe,
    row_kv_estimate,
    serve_probe,
)

SERVE_TARGETS = {
    "rlkv s=0.5": (1.5, "rlkv s=0.5 tokens/s >= 1.5x full's at the same KV cap"),
    "rkv b=1024": (3.0, "rkv budget 1024 tokens/s >= 3x full's at the same KV cap"),
}
GPU_SERVE_TARGETS = {  # RLKV's SGLang runtime: 1.80x full's tokens/s at s=0.5 (issue 38)
    **SERVE_TARGETS,
    "rlkv s=0.5": (1.8, "rlkv s=0.5 tokens/s >= 1.8x full's at the same KV cap (GPU)"),
}
# the default model of a CUDA run without --model: random weights of that geometry, built on the device
GPU_MODEL = "qwen2.5-7b"


def serve_targets(device: str) -> dict[str, tuple[float, str]]:
    """The targets (threshold, text) that apply on `device`."""
    return GPU_SERVE_TARGETS if device.startswith("cuda") else SERVE_TARGETS


class ServeTimeLimit(Exception):
    """The suite's --serve-time-limit ran out before or during a probe."""


# ------------------------------------------------------------------------------------------ models
def build_serve_model(spec: str, layers: int, device: str, dtype: str):
    """(model, prompt token ids [1, P] or None) for "synthetic" (random Llama with Llama-3.1-8B
    attention geometry, `layers` layers), a geometry of benchmarks.gpu.profile.GEOMETRIES (random weights
    built on the device), "tiny:<family>" (rlkv.testing) or a model folder."""
    from benchmarks.gpu.profile import GEOMETRIES, build_random_model
    from rlkv.inference import load, resolve_dtype

    if spec in GEOMETRIES:
        return build_random_model(spec, device, resolve_dtype(dtype, device)), None
    if spec == "synthetic":
        from benchmarks.common import ATTN_SHAPE, build_model

        return build_model(ATTN_SHAPE, layers, device, resolve_dtype(dtype, device)), None
    model, tok = load(spec, dtype=dtype, device=device)
    if spec.startswith("tiny:"):
        return model, None
    from benchmarks.real import runner as bench_real

    text = bench_real.prompts(tok, 1)[0]
    return model, tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)


# ------------------------------------------------------------------------------------------- suite
def probe_worker(args) -> dict:
    """The --worker serve entry: load the model, run one probe, return its JSON."""
    model, prompt = build_serve_model(args.serve_model_spec, args.serve_layers, args.device, args.dtype)
    prompt = prompt_for(model, prompt, args.prompt_tokens, args.device)
    method = next(m for m in methods(args.serve_budget, args.policy_list) if m.name == args.method)
    return serve_probe(
        model,
        prompt,
        method,
        args.batch,
        args.serve_tokens,
        args.cap_bytes,
        args.device,
        args.mask,
        protect_prompt=protect_prompt(args.serve_model_spec),
    )


def prompt_for(model, prompt: torch.Tensor | None, length: int, device: str) -> torch.Tensor:
    """The given prompt, or `length` random token ids (fixed seed) for a model without a tokenizer."""
    if prompt is not None:
        return prompt
    gen = torch.Generator().manual_seed(0)
    return torch.randint(1, model.config.vocab_size, (1, length), generator=gen).to(device)


def worker_command(args, method: Method, batch: int) -> list[str]:
    """The command line of one probe in its own process."""
    cmd = [*module_command("benchmarks.serve.runner"), "--worker", "serve", "--method", method.name]
    cmd += ["--batch", str(batch), "--cap-bytes", str(args.cap_bytes), "--device", args.device]
    cmd += ["--serve-model-spec", args.serve_model_spec, "--serve-layers", str(args.serve_layers)]
    cmd += ["--dtype", args.dtype, "--serve-tokens", str(args.serve_tokens)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--serve-budget", str(args.serve_budget)]
    cmd += ["--serve-policies", ",".join(args.policy_list), "--threads", str(args.threads)]
    return cmd + (["--mask", args.mask] if args.mask else [])


def subprocess_probe(args, method: Method) -> Callable[[int], dict]:
    """probe(batch) running `worker_command` in a fresh process (none starts past --serve-time-limit)."""

    def probe(batch: int) -> dict:
        if time.perf_counter() > args.deadline:
            raise ServeTimeLimit(f"{method.name} B={batch}: not started")
        proc = subprocess.run(
            worker_command(args, method, batch), capture_output=True, text=True, env=child_env()
        )
        if proc.returncode != 0:
            raise RuntimeError(f"serve probe {method.name!r} batch {batch} failed:\n{proc.stderr[-3000:]}")
        return log_probe(json.loads(proc.stdout.strip().splitlines()[-1]))

    return probe


def in_process_probe(args, method: Method, model, prompt: torch.Tensor) -> Callable[[int], dict]:
    """probe(batch) in this process, on an already loaded model."""

    def probe(batch: int) -> dict:
        if time.perf_counter() > args.deadline:
            raise ServeTimeLimit(f"{method.name} B={batch}: not started")
        r = serve_probe(
            model,
            prompt,
            method,
            batch,
            args.serve_tokens,
            args.cap_bytes,
            args.device,
            args.mask,
            protect_prompt=protect_prompt(args.serve_model_spec),
            deadline=args.deadline,
        )
        if r.get("timed_out"):
            raise ServeTimeLimit(f"{method.name} B={batch}: stopped after {r['generated']} tokens")
        return log_probe(r)

    return probe


def log_probe(r: dict) -> dict:
    """Print one probe's outcome; returns it."""
    tps = f"{r['whole_tokens_per_s']:.1f} tok/s" if r["fits"] else f"stopped after {r['generated']} tokens"
    print(
        f"  serve: {r['method']} B={r['batch']}: {'fits' if r['fits'] else 'over'} "
        f"(peak KV {r['peak_kv_bytes'] / 2**20:.1f} MiB) {tps}",
        flush=True,
    )
    return r


def resolve_serve_args(args) -> None:
    """Fill the suite's derived settings (model spec, cap in bytes, --quick sizes, the GPU defaults) on `args`."""
    gpu = args.device.startswith("cuda") and not args.quick
    if args.serve_model == "auto":
        args.serve_model_spec = args.model or (
            "tiny:llama" if args.quick else GPU_MODEL if gpu else "synthetic"
        )
    else:
        args.serve_model_spec = args.serve_model
    random_geometry = not protect_prompt(args.serve_model_spec)
    if args.serve_tokens is None:  # a GPU row: 3584 prompt + 512 new = 4096 tokens, in seconds per probe
        args.serve_tokens = 512 if random_geometry else 4096
    if args.prompt_tokens is None:
        args.prompt_tokens = 3584 if random_geometry else 64
    if getattr(args, "serve_time_limit", None) is None:
        args.serve_time_limit = 420.0 if gpu else float("inf")
    args.deadline = time.perf_counter() + args.serve_time_limit
    args.policy_list = [p for p in (args.serve_policies or "").split(",") if p]
    if args.quick:  # a smoke run: tiny model, short generations, budget just above sink + window
        args.serve_tokens, args.prompt_tokens = min(args.serve_tokens, 160), 16
        args.serve_budget = min(args.serve_budget, 96)
        if args.kv_cap_gib is None:
            full = methods(args.serve_budget, [])[0]
            args.kv_cap_gib = 3 * row_kv_estimate(args, full, kv_geometry(args)) / 2**30
    if args.kv_cap_gib is None and random_geometry:  # full fits exactly 16 rows (its last token is never fed)
        full = methods(args.serve_budget, [])[0]
        args.kv_cap_gib = 16 * row_kv_estimate(args, full, kv_geometry(args)) / 2**30
    if args.kv_cap_gib is None:
        args.kv_cap_gib = 0.25 if args.serve_model_spec != "synthetic" else 0.125
    args.cap_bytes = int(args.kv_cap_gib * 2**30)


def suite_serve(args) -> dict:
    """Every method's batch search and measurements under one KV cap, side by side, with verdicts."""
    resolve_serve_args(args)
    print(
        f"  serve: model {args.serve_model_spec}, cap {args.kv_cap_gib:.3f} GiB, "
        f"{args.serve_tokens} new tokens, device {args.device}",
        flush=True,
    )
    rows = []
    shared = None
    geometry = kv_geometry(args)
    if args.quick or args.device.startswith("cuda"):  # one process: seconds (--quick; peak RSS is then
        # not per probe), or one model build on a GPU (peak CUDA memory is reset per probe)
        model, prompt = build_serve_model(args.serve_model_spec, args.serve_layers, args.device, args.dtype)
        shared = (model, prompt_for(model, prompt, args.prompt_tokens, args.device))
    for method in methods(args.serve_budget, args.policy_list):
        if shared:
            probe = in_process_probe(args, method, *shared)
        else:  # probes take minutes on a real model: recorded under --out, reused by a rerun
            probe = recorded_probe(subprocess_probe(args, method), probe_log(args), probe_key(args, method))
        guess = args.cap_bytes // row_kv_estimate(args, method, geometry)
        done: list[dict] = []  # the probes that finished, kept when the time limit cuts the search

        def recording(batch: int, probe=probe, done=done) -> dict:
            done.append(probe(batch))
            return done[-1]

        try:
            rows.append(method_row(method, find_max_batch(recording, args.max_batch, guess)))
        except ServeTimeLimit as e:
            print(f"  serve: time limit ({args.serve_time_limit:.0f}s): {e}", flush=True)
            rows.append(method_row(method, partial_search(done), cut=True))
    return serve_summary(rows, args)


def partial_search(probes: list[dict]) -> dict | None:
    """A search cut by the time limit, from its finished probes: the largest batch that fitted and the
    smallest that did not so far (None when no probe finished)."""
    if not probes:
        return None
    fits = [p for p in probes if p["fits"]]
    overs = [p for p in probes if not p["fits"]]
    fit = max(fits, key=lambda p: p["batch"]) if fits else None
    over = min(overs, key=lambda p: p["batch"]) if overs else None
    return dict(
        fit=fit["batch"] if fit else 0,
        over=over["batch"] if over else None,
        fit_result=fit,
        over_result=over,
        probes=probes,
    )


def method_row(method: Method, search: dict | None, cut: bool = False) -> dict:
    """One method's report row from its batch search (None: skipped at the time limit; `cut`: the time
    limit ended the search, so the max batch is a lower bound)."""
    status = "skipped (time limit)" if search is None else "measured"
    if search is not None and cut:
        status = "search cut by the time limit"
    search = search or dict(fit=None, over=None, fit_result=None, over_result=None, probes=[])
    best = search["fit_result"] or {}
    return dict(
        method=method.name,
        status=status,
        policy=method.policy or "none (DynamicCache, sdpa)",
        sparsity=method.sparsity,
        budget=method.budget,
        max_batch=search["fit"],
        first_over_batch=search["over"],
        over_peak_kv_bytes=(search["over_result"] or {}).get("peak_kv_bytes"),
        decode_tokens_per_s=best.get("decode_tokens_per_s"),
        whole_tokens_per_s=best.get("whole_tokens_per_s"),
        peak_kv_bytes=best.get("peak_kv_bytes"),
        peak_rss_bytes=best.get("peak_rss_bytes"),
        peak_cuda_bytes=best.get("peak_cuda_bytes"),
        probes=search["probes"],
    )


def serve_summary(rows: list[dict], args) -> dict:
    """Ratios to full (same cap) and the verdicts of SERVE_TARGETS."""
    full = next(r for r in rows if r["method"] == "full")
    for r in rows:
        for key in ("decode_tokens_per_s", "whole_tokens_per_s"):
            ok = r[key] is not None and full[key]
            r[key.replace("tokens_per_s", "vs_full")] = r[key] / full[key] if ok else None
        ok = r["max_batch"] is not None and full["max_batch"]
        r["max_batch_vs_full"] = r["max_batch"] / full["max_batch"] if ok else None
    verdicts = {}
    for name, (threshold, _) in serve_targets(args.device).items():
        name = name.replace("1024", str(args.serve_budget))
        row = next((r for r in rows if r["method"] == name), None)
        if row is not None:
            verdicts[name] = row["decode_vs_full"] is not None and row["decode_vs_full"] >= threshold
    return dict(
        model=args.serve_model_spec,
        device=args.device,
        dtype=args.dtype,
        threads=torch.get_num_threads(),
        cap_bytes=args.cap_bytes,
        prompt_tokens=args.prompt_tokens,
        protect_prompt=protect_prompt(args.serve_model_spec),
        time_limit_s=args.serve_time_limit,
        new_tokens=args.serve_tokens,
        budget=args.serve_budget,
        rows=rows,
        verdicts=verdicts,
        passed=bool(verdicts) and all(verdicts.values()),
    )


# ------------------------------------------------------------------------------------------ options
def add_options(parser: argparse.ArgumentParser) -> None:
    """The serve suite's options (shared by `python -m benchmarks --suite serve and the worker command line)."""
    parser.add_argument(
        "--kv-cap-gib", type=float, help="KV cap in GiB (default 0.25 real model, 0.125 synthetic)"
    )
    parser.add_argument(
        "--serve-model",
        default="auto",
        help="synthetic (Llama-3.1-8B attention, random weights), qwen2.5-7b / llama-3.1-8b (random weights, "
        "whole model), tiny:llama, a folder; auto: --model, else qwen2.5-7b on CUDA, synthetic on CPU",
    )
    parser.add_argument("--serve-layers", type=int, default=2, help="layers of the synthetic model")
    parser.add_argument(
        "--serve-tokens",
        type=int,
        help="generated tokens per row, EOS suppressed (4096; 512 on a random geometry)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        help="prompt length of models without a tokenizer (64; 3584 on a random geometry)",
    )
    parser.add_argument(
        "--serve-time-limit",
        type=float,
        help="seconds for the whole suite; later probes are skipped (default 420 on CUDA, none on CPU)",
    )
    parser.add_argument(
        "--serve-budget", type=int, default=1024, help="token budget of rkv and --serve-policies"
    )
    parser.add_argument(
        "--serve-policies", default="", help="comma list of extra registered policies (all heads)"
    )
    parser.add_argument("--mask", help="head mask for the rlkv rows (default: a random mask, seed 0)")
    parser.add_argument("--max-batch", type=int, default=1024, help="largest batch the search tries")


def main(argv: list[str] | None = None) -> int:
    """The probe worker: one measurement in this process, its JSON on the last stdout line."""
    from benchmarks.real import runner as bench_real

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=["serve"], required=True)
    parser.add_argument("--method", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--cap-bytes", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--serve-model-spec", required=True)
    add_options(parser)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args(argv)
    args.policy_list = [p for p in args.serve_policies.split(",") if p]
    torch.set_num_threads(args.threads or bench_real.cores())
    print(json.dumps(probe_worker(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
