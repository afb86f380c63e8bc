"""The memory suite of `python -m benchmarks` (resident KV bytes against the analytic count, each mode in
its own process) and the max-batch table derived from it."""

from __future__ import annotations

import json
import resource
import subprocess

import torch

from benchmarks.common import (
    MODES,
    SMALL_SHAPE,
    TARGETS,
    build_model,
    child_env,
    compression_for,
    module_command,
)
from rlkv.compat import cache_kwargs
from rlkv.inference import make_cache

CAP_BYTES = 8 * 2**30
LLAMA8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16


def analytic_bytes(cache) -> tuple[int, int]:
    """(KV payload of the tokens kept, payload + the bookkeeping the design declares), from kept counts.

    KV: every full head holds each real token; a compressed head holds its valid slots. Bookkeeping:
    one int32 logical position per compressed slot (store.positions), the policy's query window and slot buffers.
    """
    kv = book = 0
    for layer in cache.layers:
        store = layer.store
        sample = layer.keys if layer.keys is not None else store.keys
        batch, _, _, dim = sample.shape
        per_token = 2 * dim * sample.element_size()
        kv += int(layer.full_idx.numel()) * layer.logical_length * batch * per_token
        if store is not None and store.positions is not None:
            slots = store.positions.numel()  # padded to the largest (row, head) count: counted as used
            kv += slots * per_token
            book += slots * store.positions.element_size()
            book += sum(buf.numel() * buf.element_size() for buf, _ in store._slot_buffers.values())
            if store.queries is not None:
                book += (
                    store.queries.numel() * store.queries.element_size() + store.query_positions.numel() * 8
                )
    return kv, kv + book


def memory_worker(mode: str, lengths: list[int], device: str, chunk: int) -> dict:
    """Feed random tokens up to each logical length; report resident/analytic bytes and peak memory.

    Multi-token forwards count as (chunked) prompt for the cache, so policies whose schedule counts
    generated tokens (RPC) get a `chunk`-token prompt and then single-token decode steps.
    """
    decode_steps = MODES[mode][1] == "rpc"
    model = build_model(SMALL_SHAPE, 2, device, torch.float32)
    cache = make_cache(model, compression_for(model, mode))
    baseline_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base_cuda = torch.cuda.memory_allocated()
    gen = torch.Generator().manual_seed(0)
    rows, seen = [], 0
    with torch.no_grad():
        for target in sorted(lengths):
            while seen < target:
                n = 1 if decode_steps and seen >= chunk else min(chunk, target - seen)
                ids = torch.randint(0, 512, (1, n), generator=gen).to(device)
                model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
                seen += n
            kv, analytic = analytic_bytes(cache)
            resident = cache.resident_bytes()
            rows.append(
                dict(
                    mode=mode,
                    length=target,
                    resident_bytes=resident,
                    full_bytes=cache.full_resident_bytes(),
                    kv_payload_bytes=kv,
                    analytic_bytes=analytic,
                    ratio_vs_analytic=resident / analytic,
                    ratio_vs_full=resident / cache.full_resident_bytes(),
                )
            )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - baseline_rss
    if device.startswith("cuda"):
        peak = torch.cuda.max_memory_allocated() - base_cuda
    return dict(rows=rows, peak_extra_bytes=peak)


def suite_memory(args) -> dict:
    results, peaks = [], {}
    for mode in MODES:
        cmd = [  # `python -m benchmarks --worker memory` runs memory_worker
            *module_command("benchmarks"),
            "--worker",
            "memory",
            "--mode",
            mode,
            "--device",
            args.device,
            "--lengths",
            ",".join(map(str, args.mem_lengths)),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=child_env())
        if out.returncode != 0:
            raise RuntimeError(f"memory worker {mode!r} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        results += res["rows"]
        peaks[mode] = res["peak_extra_bytes"]
        print(f"  memory: {mode} done", flush=True)
    worst = max(r["ratio_vs_analytic"] for r in results)
    return dict(rows=results, peak_extra_bytes=peaks, worst_ratio_vs_analytic=worst, passed=worst <= 1.01)


def suite_maxbatch(memory: dict) -> dict:
    """Largest batch under an 8 GiB KV cap, from measured per-sequence bytes at the longest length."""
    longest = max(r["length"] for r in memory["rows"])
    rows = []
    for r in (r for r in memory["rows"] if r["length"] == longest):
        # measured resident/full ratio applied to Llama-3.1-8B's KV bytes at the same length (bf16)
        per_seq = r["ratio_vs_full"] * LLAMA8B_KV_BYTES_PER_TOKEN * longest
        rows.append(
            dict(
                mode=r["mode"],
                length=longest,
                ratio_vs_full=r["ratio_vs_full"],
                llama8b_bytes_per_sequence=per_seq,
                max_batch=int(CAP_BYTES // per_seq),
            )
        )
    full = next(r["max_batch"] for r in rows if r["mode"] == "full")
    for r in rows:
        r["max_batch_vs_full"] = r["max_batch"] / max(full, 1)
    return dict(rows=rows, cap_bytes=CAP_BYTES)


def gib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report_memory(m: dict) -> list[str]:
    """Markdown lines for the memory suite."""
    lines = [
        "## Memory (resident KV bytes, small GQA Llama, batch 1, fp32)",
        "",
        "| mode | length | resident | vs full | vs analytic | peak extra |",
        "|---|---|---|---|---|---|",
    ]
    for r in m["rows"]:
        lines.append(
            f"| {r['mode']} | {r['length']} | {gib(r['resident_bytes'])} | {r['ratio_vs_full']:.3f} | "
            f"{r['ratio_vs_analytic']:.4f} | {gib(m['peak_extra_bytes'][r['mode']])} |"
        )
    return lines + [
        "",
        f"worst resident/analytic = {m['worst_ratio_vs_analytic']:.4f}  "
        f"[{'PASS' if m['passed'] else 'FAIL'}: {TARGETS['memory']}]",
        "",
    ]


def report_maxbatch(b: dict) -> list[str]:
    """Markdown lines for the max-batch table."""
    lines = [
        "## Max batch under 8 GiB of KV (Llama-3.1-8B geometry, bf16, measured ratios)",
        "",
        "| mode | length | per sequence | max batch | vs full |",
        "|---|---|---|---|---|",
    ]
    for r in b["rows"]:
        lines.append(
            f"| {r['mode']} | {r['length']} | {gib(r['llama8b_bytes_per_sequence'])} | {r['max_batch']} | "
            f"{r['max_batch_vs_full']:.1f}x |"
        )
    return lines + [""]
