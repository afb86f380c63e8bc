"""rlkv benchmarks: memory, decode speed, compression overhead, training overhead and max batch.

Every number is a ratio measured side by side in one run, printed as tables with PASS/FAIL
against the targets of the performance issue, and written as JSON + PNG under --out.

    python -m benchmarks --suite all --out runs/bench           # default suite, CPU, < 15 min
    python -m benchmarks --suite decode,memory --long            # adds 32K contexts / 8K training
    python -m benchmarks --suite all --device cuda               # CUDA events, max_memory_allocated

Shapes: memory and overhead use a small GQA Llama (cheap to fill to 32K tokens; bytes scale
linearly with layers x KV heads x head_dim, so ratios carry over); decode and training use
Llama-3.1-8B attention dims (32 query heads, 8 KV heads, head_dim 128) with 2 layers, hidden
1024 and random weights, so attention dominates as it does at long context in the real model.
"""

# This file is the command line (`python -m benchmarks`, `make bench`, `rlkv bench`) and the combined
# report; each suite is its own subpackage with its runner and report: memory (memory, maxbatch), decode,
# overhead, train, real, serve (runner, probe, report), gpu and gpu_train; what they share is in common.

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import MODES
from benchmarks.decode.runner import report_decode, suite_decode
from benchmarks.gpu import runner as bench_gpu
from benchmarks.gpu_train import runner as bench_gpu_train
from benchmarks.memory.runner import (
    memory_worker,
    report_maxbatch,
    report_memory,
    suite_maxbatch,
    suite_memory,
)
from benchmarks.overhead.runner import report_overhead, suite_overhead
from benchmarks.real import runner as bench_real
from benchmarks.serve import runner as bench_serve
from benchmarks.serve.report import plot_serve, report_serve
from benchmarks.train.runner import report_train, suite_train
from benchmarks.vllm import runner as bench_vllm
from benchmarks.vllm.report import report_vllm
from rlkv._io import atomic_write_text

SECTIONS = {  # the report's sections after the real-model one, in order
    "gpu": bench_gpu.report_gpu,
    "serve": report_serve,
    "memory": report_memory,
    "maxbatch": report_maxbatch,
    "decode": report_decode,
    "overhead": report_overhead,
    "train": report_train,
    "gpu-train": bench_gpu_train.report_gpu_train,
    "vllm": report_vllm,
}


def report(results: dict) -> str:
    lines = bench_real.report_real(results["real"]) + [""] if "real" in results else []
    for name, section in SECTIONS.items():
        if name in results:
            lines += section(results[name])
    return "\n".join(lines)


def plots(results: dict, out: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install 'rlkv[plots]' for PNG plots", file=sys.stderr)
        return []
    written = []
    if "serve" in results and (serve_png := plot_serve(results["serve"], out / "bench_serve.png")):
        written.append(serve_png)
    if "memory" not in results and "decode" not in results:
        return written  # bench.png draws those two suites only (an empty figure otherwise)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    if "memory" in results:
        ax = axes[0]
        for mode in MODES:
            rows = [r for r in results["memory"]["rows"] if r["mode"] == mode]
            ax.plot([r["length"] for r in rows], [r["ratio_vs_full"] for r in rows], marker="o", label=mode)
        ax.set(xscale="log", xlabel="logical length (tokens)", ylabel="resident KV / full", title="KV memory")
        ax.legend(fontsize=7)
    if "decode" in results:
        ax = axes[1]
        rows = results["decode"]["rows"]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            sel = [r for r in rows if r["mode"] == mode and r["batch"] == min(r2["batch"] for r2 in rows)]
            ax.plot(
                [r["context"] for r in sel],
                [r["seconds_per_step"] * 1e3 for r in sel],
                marker="o",
                label=mode,
            )
        ax.set(xscale="log", xlabel="context (tokens)", ylabel="ms / token", title="decode step (batch 1)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    return written


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--suite",
        default="all",
        help="comma list of memory,decode,overhead,train,maxbatch or all; real (needs --model) runs a real "
        "LLM; serve: throughput at a fixed KV cap (--model, or a synthetic model); gpu: decode of Qwen2.5-7B's "
        "geometry, plain transformers vs rlkv (--device cuda; --quick: tiny, CPU); gpu-train: one GRPO step on "
        "Qwen2.5-7B's geometry (--device cuda; --quick: tiny, CPU); vllm: stock vLLM vs rlkv on vLLM at a fixed KV "
        "cache size (run in .venv-vllm)",
    )
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--long", action="store_true", help="add 32K contexts and 8K training")
    parser.add_argument("--quick", action="store_true", help="short lengths only (a smoke run in seconds)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--lengths", help=argparse.SUPPRESS)
    bench_real.add_options(parser)
    bench_serve.add_options(parser)
    bench_gpu.add_options(parser)
    bench_gpu_train.add_options(parser)
    bench_vllm.add_options(parser)
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if args.worker == "memory":
        print(json.dumps(memory_worker(args.mode, parse_ints(args.lengths), args.device, chunk=256)))
        return 0

    args.mem_lengths = [2048, 4096, 8192, 16384] + ([32768] if args.long else [])
    args.ctx_lengths = [1024, 4096, 16384] + ([32768] if args.long else [])
    args.batches = [1, 8]
    args.decode_steps, args.decode_repeats = 8, 3  # decode: best of 3 passes of 8 steps per cell
    args.overhead_steps = 300
    args.train_lengths = [2048, 4096] + ([8192] if args.long else [])
    if args.quick:
        args.mem_lengths, args.ctx_lengths, args.batches = [512, 1024], [256, 1024], [1, 2]
        args.decode_steps, args.decode_repeats, args.overhead_steps, args.train_lengths = 2, 1, 140, [512]
    suites = (
        ["memory", "decode", "overhead", "train", "maxbatch"]
        if args.suite == "all"
        else args.suite.split(",")
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results: dict = {"device": args.device, "torch": torch.__version__, "threads": torch.get_num_threads()}
    started = time.perf_counter()
    for name in suites:
        if name == "maxbatch":
            if "memory" not in results:
                results["memory"] = suite_memory(args)
            results["maxbatch"] = suite_maxbatch(results["memory"])
            continue
        print(f"[{name}]", flush=True)
        results[name] = {
            "memory": suite_memory,
            "decode": suite_decode,
            "overhead": suite_overhead,
            "train": suite_train,
            "real": bench_real.suite_real,
            "serve": bench_serve.suite_serve,
            "gpu": bench_gpu.suite_gpu,
            "gpu-train": bench_gpu_train.suite_gpu_train,
            "vllm": bench_vllm.suite_vllm,
        }[name](args)
    results["wall_seconds"] = time.perf_counter() - started
    text = report(results)
    print("\n" + text)
    atomic_write_text(out / "bench.json", json.dumps(results, indent=1, default=str))
    atomic_write_text(out / "bench.md", text + "\n")
    written = plots(results, out)
    print(
        f"wrote {out / 'bench.json'}, {out / 'bench.md'} {' '.join(written)} in {results['wall_seconds']:.0f}s"
    )
    verdicts = {s: results[s]["passed"] for s in suites if "passed" in results.get(s, {})}
    failed = [s for s, ok in verdicts.items() if not ok]
    # a suite passes when every target in its table does
    print(
        f"suites: {len(verdicts) - len(failed)} PASS, {len(failed)} FAIL"
        + (f" ({', '.join(failed)})" if failed else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
