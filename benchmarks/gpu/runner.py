"""The GPU suite of `python -m benchmarks` (`--suite gpu`): decode throughput of plain transformers and rlkv on
random weights of a real geometry, in one run under a time budget.

    python -m benchmarks --suite gpu --device cuda --out runs/bench-gpu       # H100/H200, ~7 min
    python -m benchmarks --suite gpu --quick --out /tmp/gpu-smoke              # CPU smoke, tiny geometry

Every row runs `model.generate` greedily on `--gpu-batches` rows of a `--gpu-prompt`-token random prompt
for up to `--gpu-steps` new tokens (the model has no EOS, so every method decodes the same count), bf16
on CUDA. Rows: plain transformers eager (torch's default SDPA backend, and the flash backend pinned),
plain transformers with a StaticCache + torch.compile (transformers' compile_config, CUDA graphs via
mode "reduce-overhead"), rlkv at s=0, 0.5, 0.75 (a random head mask, streaming heads), rkv budget
1024 on every head and rlkv+rkv s=0.5, each rlkv row in the dynamic cache and, when rlkv has one
(`make_cache(..., static=True, max_cache_len=N)`), the static cache compiled the same way.
Per row: tokens/s and ms/step (CUDA events recorded by a stopping criterion, no sync), kernel
launches, CUDA graph launches and host syncs per step (torch.profiler over a few steps; syncs split
into those in the forward and those in generate's own loop), GPU-busy fraction, resident KV, peak
allocated and the roofline: (weights + resident KV bytes) / the card's measured copy bandwidth.
A row that would overrun `--gpu-budget-s` is recorded as skipped.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList
from transformers.generation import CompileConfig

from benchmarks.gpu.profile import (
    FORWARD_MARK,
    STEP_MARK,
    build_random_model,
    copy_bandwidth,
    profiler,
    sdpa_backends,
    step_counts,
    trace_events,
    weight_bytes_per_step,
)
from benchmarks.gpu.report import GPU_TARGETS, report_gpu, verdicts
from benchmarks.serve.probe import kv_resident_bytes
from rlkv import HeadMask
from rlkv._io import atomic_write_text
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache


@dataclass(frozen=True)
class Row:
    """One configuration: plain transformers (`policy` None) or an rlkv cache; `static`: a static cache
    (compiled with CUDA graphs on CUDA); `sdpa`: the SDPA backend pin (benchmarks.gpu.profile.sdpa_backends)."""

    name: str
    policy: str | None = None
    sparsity: float | None = None  # None: no head mask (every head compressed)
    budget: int | None = None
    static: bool = False
    sdpa: str = "default"


def rows(rlkv_sdpa: str, budget: int = 1024) -> list[Row]:
    """The suite's rows, most important first (a time budget cuts the tail); `budget`: rkv's."""

    def rlkv(name: str, policy: str, sparsity: float | None, kept: int | None) -> list[Row]:
        return [
            Row(f"{name} dynamic", policy, sparsity, kept, sdpa=rlkv_sdpa),
            Row(f"{name} static", policy, sparsity, kept, static=True, sdpa=rlkv_sdpa),
        ]

    # the targets' rows first (the two baselines, rlkv s=0.5); torch's default backend is informational
    return [
        Row("plain eager (SDPA flash)", sdpa="flash"),
        Row("plain StaticCache + compile", static=True),
        *rlkv("rlkv s=0.5", "streaming", 0.5, None),
        Row("plain eager (SDPA default)"),
        *rlkv("rlkv s=0", "streaming", 0.0, None),
        *rlkv("rlkv s=0.75", "streaming", 0.75, None),
        *rlkv(f"rkv b={budget}", "rkv", None, budget),
        *rlkv("rlkv+rkv s=0.5", "rkv", 0.5, budget),
    ]


def static_unavailable() -> str | None:
    """Why rlkv has no static cache yet (None when `make_cache` takes static= and max_cache_len=)."""
    params = inspect.signature(make_cache).parameters
    if "static" in params and "max_cache_len" in params:
        return None
    return "not available: make_cache has no static=/max_cache_len= (no static rlkv cache in this version)"


def row_cache(model, row: Row, batch: int, max_len: int):
    """The cache of `row` for `batch` rows of up to `max_len` tokens."""
    if row.policy is None:  # stock attention again after an rlkv row switched it to "rlkv_cache"
        model.set_attn_implementation("sdpa")
        if row.static:
            return StaticCache(config=model.config, max_cache_len=max_len)
        return DynamicCache(config=model.config)
    config = CompressionConfig(
        head_mask=HeadMask.random(model, seed=0) if row.sparsity is not None else None,
        sparsity=row.sparsity if row.sparsity is not None else 1.0,
        policy=row.policy,
        budget=row.budget,
        protect_prompt=False,  # the prompt stands in for generated reasoning: every token is evictable
    )
    if row.static:
        return make_cache(model, config, batch_size=batch, static=True, max_cache_len=max_len)
    return make_cache(model, config)


class StepClock(StoppingCriteria):
    """Called once per generated token: records a timestamp (a CUDA event, no sync), profiles steps
    [warm, warm + profile_steps) and stops every row once the row's time is up."""

    def __init__(self, batch: int, device: str, warm: int, profile_steps: int, row_s: float, hard_end: float):
        self.device, self.warm, self.profile_steps = device, warm, profile_steps
        self.row_s, self.hard_end, self.deadline = row_s, hard_end, hard_end
        self.stamps: list = []
        self.host: list[float] = []
        self.prof = None
        self.profiling = False
        self.keep = torch.zeros(batch, dtype=torch.bool, device=device)
        self.stop = torch.ones(batch, dtype=torch.bool, device=device)

    def stamp(self):
        if self.device.startswith("cuda"):
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        step = len(self.stamps)
        if step == self.warm:
            self.prof = profiler(self.device)
            self.prof.start()
            self.profiling = True
        if self.profiling:
            with torch.profiler.record_function(STEP_MARK):
                pass
        if step == self.warm + self.profile_steps:
            self.prof.stop()
            self.profiling = False
            self.deadline = min(self.hard_end, time.perf_counter() + self.row_s)
        self.stamps.append(self.stamp())
        self.host.append(time.perf_counter())
        return self.stop if time.perf_counter() > self.deadline else self.keep

    def seconds(self, i: int, j: int) -> float:
        """Seconds from stamp i to stamp j."""
        if self.device.startswith("cuda"):
            return self.stamps[i].elapsed_time(self.stamps[j]) / 1e3
        return self.stamps[j] - self.stamps[i]


def measure(model, row: Row, batch: int, args, hard_end: float) -> dict:
    """One row: generate, then its timings, profile counts, memory and roofline (see the module doc)."""
    device = args.device
    out = dict(asdict(row), batch=batch, status="ok")
    if row.static and row.policy is not None and (why := static_unavailable()):
        return dict(out, status=why)
    gc.collect()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    max_len = args.gpu_prompt + args.gpu_steps
    if cuda and row.static:  # a fresh compile per static row: no stale CUDA graph pools, no recompile limit
        torch.compiler.reset()
    try:
        cache = row_cache(model, row, batch, max_len)
    except (ValueError, TypeError, NotImplementedError) as e:
        return dict(out, status=f"not available: {e}")
    # transformers compiles the decode step only on CUDA and only for a compileable cache
    compiled = cuda and row.static and bool(getattr(cache, "is_compileable", False))
    warm = args.gpu_warm + (args.gpu_warm_compiled if compiled else 0)
    clock = StepClock(batch, device, warm, args.gpu_profile_steps, args.gpu_row_s, hard_end)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(1, model.config.vocab_size, (batch, args.gpu_prompt), generator=gen).to(device)
    # the forward mark tells generate's own per-step syncs from the forward's; a compiled forward
    # would trace the hook, so compiled rows go without it
    hook = None if compiled else model.register_forward_pre_hook(_forward_mark)
    start = clock.stamp()
    try:
        with sdpa_backends(row.sdpa, device), torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **cache_kwargs(cache),
                max_new_tokens=args.gpu_steps,
                do_sample=False,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([clock]),
                **({"compile_config": compile_config(row)} if row.static else {}),
            )
    except torch.OutOfMemoryError:
        return dict(out, status="out of memory")
    finally:
        if hook is not None:
            hook.remove()
        if clock.profiling:  # generate ended inside the profiled steps (the time budget)
            clock.prof.stop()
    if cuda:
        torch.cuda.synchronize()
    first = warm + args.gpu_profile_steps + 1  # the first step after the profiled ones
    done = len(clock.stamps)
    timed = done - 1 - first
    if timed < 1:
        return dict(out, status=f"too few steps ({done}) in the row's time", steps=done)
    step_s = clock.seconds(first, done - 1) / timed
    counts = step_counts(trace_events(clock.prof), device) if clock.prof is not None else {}
    kv = kv_resident_bytes(cache)
    weights = weight_bytes_per_step(model)
    g = model.config
    per_token = 2 * g.num_hidden_layers * g.num_key_value_heads * g.head_dim * model.dtype.itemsize
    full_kv = per_token * batch * (args.gpu_prompt + done - 1)  # the last new token is never fed back
    roofline_s = (weights + kv) / args.bandwidth
    return dict(
        out,
        status="ok" if done >= args.gpu_steps else f"stopped at {done} steps (row time)",
        compiled=compiled,
        steps=done,
        timed_steps=timed,
        prefill_s=_prefill_seconds(clock, start, device),
        ms_per_step=step_s * 1e3,
        tokens_per_s=batch / step_s,
        **counts,
        resident_kv_bytes=kv,
        kv_vs_full=kv / full_kv,
        weight_bytes=weights,
        peak_allocated_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        roofline_ms=roofline_s * 1e3,
        of_roofline=roofline_s / step_s,
    )


def compile_config(row: Row) -> CompileConfig:
    """How a static row is compiled (on CUDA; transformers compiles only there): plain transformers with
    its documented default (mode "reduce-overhead": CUDA graphs), rlkv as `rlkv.inference.generate`
    does (fullgraph, static shapes, CUDA graphs)."""
    if row.policy is None:
        return CompileConfig(mode="reduce-overhead")
    return CompileConfig(fullgraph=True, dynamic=False, mode="reduce-overhead")


def _prefill_seconds(clock: StepClock, start, device: str) -> float:
    """Seconds from the call of generate to its first token (the prefill)."""
    if device.startswith("cuda"):
        return start.elapsed_time(clock.stamps[0]) / 1e3
    return clock.stamps[0] - start


def _forward_mark(module, args) -> None:
    with torch.profiler.record_function(FORWARD_MARK):
        pass


def suite_gpu(args: argparse.Namespace) -> dict:
    """Every row at every batch, most important first, until the time budget runs out."""
    started = time.perf_counter()
    resolve_gpu_args(args)
    hard_end = started + args.gpu_budget_s
    cuda = args.device.startswith("cuda")
    dtype = torch.bfloat16 if cuda else torch.float32
    args.bandwidth = copy_bandwidth(args.device, 1024 if cuda else 64)
    model = build_random_model(args.gpu_geometry, args.device, dtype)
    print(
        f"  gpu: {args.gpu_geometry} built in {time.perf_counter() - started:.0f}s, copy bandwidth "
        f"{args.bandwidth / 1e9:.0f} GB/s, budget {args.gpu_budget_s:.0f}s",
        flush=True,
    )
    results = []
    for batch in args.gpu_batches:
        for row in rows(args.gpu_rlkv_sdpa, args.gpu_budget):
            left = hard_end - time.perf_counter()
            need = args.gpu_row_s + (args.gpu_compile_s if cuda and row.static else 0)
            if left < need:
                r = dict(asdict(row), batch=batch, status=f"skipped (time budget: {left:.0f}s left)")
            else:
                t = time.perf_counter()
                try:
                    r = measure(model, row, batch, args, hard_end)
                except Exception as e:  # one broken row must not cost the whole device run
                    traceback.print_exc()
                    r = dict(asdict(row), batch=batch, status=f"error: {type(e).__name__}: {e}"[:300])
                r["wall_s"] = time.perf_counter() - t
            results.append(r)
            write_partial(args, results)
            tps = (
                f"{r['tokens_per_s']:.0f} tok/s, {r['ms_per_step']:.1f} ms/step"
                if "tokens_per_s" in r
                else ""
            )
            print(f"  gpu: B={batch} {row.name}: {r['status']} {tps}", flush=True)
    summary = dict(
        device=torch.cuda.get_device_name() if cuda else "cpu",
        geometry=args.gpu_geometry,
        dtype=str(dtype),
        prompt=args.gpu_prompt,
        steps=args.gpu_steps,
        batches=args.gpu_batches,
        bandwidth_bytes_per_s=args.bandwidth,
        budget_s=args.gpu_budget_s,
        wall_s=time.perf_counter() - started,
        rows=results,
    )
    summary["verdicts"] = verdicts(summary)
    summary["passed"] = bool(summary["verdicts"]) and all(v["verdict"] == "PASS" for v in summary["verdicts"])
    return summary


def write_partial(args: argparse.Namespace, rows_so_far: list[dict]) -> None:
    """The rows measured so far as --out/bench_gpu_rows.json: what a killed run leaves behind (bench.py
    writes the whole report at the end)."""
    if getattr(args, "out", None):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        atomic_write_text(
            Path(args.out) / "bench_gpu_rows.json", json.dumps(rows_so_far, indent=1, default=str)
        )


def resolve_gpu_args(args: argparse.Namespace) -> None:
    """--quick: the tiny geometry, batch 2, a 192-token prompt, 24 steps, rkv budget 96 (a CPU smoke
    run in seconds in which streaming heads and rkv evict)."""
    args.gpu_batches = [int(b) for b in str(args.gpu_batches).split(",") if b]
    if args.quick:
        args.gpu_geometry, args.gpu_budget = "tiny", 96
        args.gpu_batches, args.gpu_prompt = [2], 192
        args.gpu_steps, args.gpu_warm, args.gpu_profile_steps = min(args.gpu_steps, 24), 2, 3
        args.gpu_row_s = min(args.gpu_row_s, 10.0)


def add_options(parser: argparse.ArgumentParser) -> None:
    """The gpu suite's options."""
    parser.add_argument("--gpu-geometry", default="qwen2.5-7b", help="qwen2.5-7b, llama-3.1-8b or tiny")
    parser.add_argument(
        "--gpu-batches", default="16,64", help="comma list; later batches go first to the budget"
    )
    parser.add_argument("--gpu-prompt", type=int, default=4096, help="prompt tokens (random ids)")
    parser.add_argument("--gpu-budget", type=int, default=1024, help="token budget of the rkv rows")
    parser.add_argument("--gpu-steps", type=int, default=512, help="new tokens per row (no EOS)")
    parser.add_argument("--gpu-warm", type=int, default=3, help="steps before profiling and timing")
    parser.add_argument(
        "--gpu-warm-compiled", type=int, default=5, help="extra warm-up steps of compiled rows"
    )
    parser.add_argument("--gpu-profile-steps", type=int, default=4, help="steps under torch.profiler")
    parser.add_argument("--gpu-row-s", type=float, default=25.0, help="timed decode seconds per row at most")
    parser.add_argument(
        "--gpu-compile-s", type=float, default=90.0, help="time a compiled row may need first"
    )
    parser.add_argument("--gpu-budget-s", type=float, default=420.0, help="the whole suite's time budget")
    parser.add_argument(
        "--gpu-rlkv-sdpa",
        default="default",
        choices=["default", "flash", "no-cudnn"],
        help="SDPA backend pin for the rlkv rows (default: none, as a user runs it)",
    )


__all__ = ["GPU_TARGETS", "add_options", "report_gpu", "suite_gpu", "verdicts"]
