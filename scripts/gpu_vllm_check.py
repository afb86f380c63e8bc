"""The check of issue 87 a GPU machine with vLLM runs: launches per decode step and decode tokens/s, rlkv vs stock.

No GPU machine lent to this project has vLLM yet (docs/guides/gpu.md), so this script is ready for one, and runs
on vLLM's CPU install as a smoke test (ops counted by torch's dispatch mode there, as the dispatch benchmark):

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python scripts/gpu_vllm_check.py --out /tmp/vllm_check.md
    VLLM_ENABLE_V1_MULTIPROCESSING=0 .venv-vllm/bin/python scripts/gpu_vllm_check.py --device cpu --quick

Per engine (stock vLLM, then rlkv's eval form at each sparsity, a random mask of a random-weights model of
Llama-3.1-8B's attention geometry: 32 layers, 32 query / 8 KV heads, head_dim 128, small MLPs): `--batch`
prompts of `--prompt` random tokens; once every prompt is done, `--steps` decode steps under the profiler
(CUDA: kernel and CUDA-graph launches from the CUDA runtime's calls; CPU: every dispatched op), then the
same steps timed alone. On CUDA vLLM captures graphs (`enforce_eager=False`). Prints and writes one markdown
table with each engine's ratio to stock and PASS/FAIL against issue 87's targets: at most 1.3x stock's
launches per step and at least 1.0x its decode tokens/s.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks/ beside rlkv/

LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cudaGraphLaunch")
MAX_LAUNCH_RATIO, MIN_SPEED_RATIO = 1.3, 1.0


def launches_per_step(engine, steps: int, device: str) -> float:
    """Mean launches (CUDA) or dispatched ops (CPU) per `engine.step()` over `steps` steps."""
    if device == "cpu":
        from benchmarks.vllm.dispatch import OpCounter

        with OpCounter() as counter:
            for _ in range(steps):
                engine.step()
        return sum(counter.ops.values()) / steps
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_CALLS) / steps


def measure(model: str, overrides: dict | None, args: argparse.Namespace) -> dict:
    """One engine's launches per decode step and decode tokens/s."""
    import vllm

    cuda = args.device == "cuda"
    llm = vllm.LLM(
        model=model,
        dtype="bfloat16" if cuda else "float32",
        enforce_eager=not cuda,
        block_size=16 if cuda else 32,
        seed=0,
        max_model_len=args.prompt + 3 * args.steps + 64,
        enable_prefix_caching=False,
        skip_tokenizer_init=True,
        max_num_seqs=args.batch,
        hf_overrides=overrides or {},
        **({"gpu_memory_utilization": 0.4} if cuda else {"kv_cache_memory_bytes": 1 << 30}),
    )
    engine = llm.llm_engine
    generator = torch.Generator().manual_seed(0)
    params = vllm.SamplingParams(
        temperature=0, max_tokens=3 * args.steps + 32, ignore_eos=True, detokenize=False
    )
    for i, ids in enumerate(torch.randint(10, 500, (args.batch, args.prompt), generator=generator).tolist()):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    started: set[str] = set()
    while len(started) < args.batch:  # every prompt computed: the steps after are decode steps
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
    launches = launches_per_step(engine, args.steps, args.device)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    engine.engine_core.shutdown()
    del llm, engine
    gc.collect()
    return {"launches": launches, "tokens_per_s": args.batch * args.steps / seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.5, 0.75])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="batch 4, prompts of 96 tokens, 4 steps")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.prompt, args.steps = 4, 96, 4
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the profiler sees the engine's steps
    from transformers import AutoModelForCausalLM

    from benchmarks.vllm.dispatch import llama_8b_geometry
    from rlkv import HeadMask
    from rlkv.inference.vllm import compression_overrides, vllm_compression

    with tempfile.TemporaryDirectory() as tmp:
        model = str(llama_8b_geometry(Path(tmp) / "llama8b"))
        mask = HeadMask.random(AutoModelForCausalLM.from_pretrained(model), seed=0)
        rows = [("stock", measure(model, None, args))]
        for sparsity in args.sparsity:
            overrides = compression_overrides(model, vllm_compression(mask, sparsity))
            rows.append((f"rlkv s={sparsity}", measure(model, overrides, args)))
    stock = rows[0][1]
    unit = "launches" if args.device == "cuda" else "ops"
    lines = [
        f"| engine | {unit} / step | vs stock | decode tokens/s | vs stock | |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    failed = False
    for name, row in rows:
        launch_ratio, speed_ratio = (
            row["launches"] / stock["launches"],
            row["tokens_per_s"] / stock["tokens_per_s"],
        )
        ok = launch_ratio <= MAX_LAUNCH_RATIO and speed_ratio >= MIN_SPEED_RATIO
        failed |= not ok
        lines.append(
            f"| {name} | {row['launches']:.0f} | {launch_ratio:.2f}x | {row['tokens_per_s']:.1f} | "
            f"{speed_ratio:.2f}x | {'PASS' if ok else 'FAIL'} |"
        )
    table = "\n".join(
        [f"device {args.device}, batch {args.batch}, prompt {args.prompt}, {args.steps} steps", *lines]
    )
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
