"""rlkv benchmarks: memory, decode speed, compression overhead, training overhead and max batch.

Every number is a ratio measured side by side in one run, printed as tables with PASS/FAIL
against the targets of the performance issue, and written as JSON + PNG under --out.

    python scripts/bench.py --suite all --out runs/bench           # default suite, CPU, < 15 min
    python scripts/bench.py --suite decode,memory --long            # adds 32K contexts / 8K training
    python scripts/bench.py --suite all --device cuda               # CUDA events, max_memory_allocated

Shapes: memory and overhead use a small GQA Llama (cheap to fill to 32K tokens; bytes scale
linearly with layers x KV heads x head_dim, so ratios carry over); decode and training use
Llama-3.1-8B attention dims (32 query heads, 8 KV heads, head_dim 128) with 2 layers, hidden
1024 and random weights, so attention dominates as it does at long context in the real model.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import bench_real
import bench_serve
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

import rlkv
from rlkv import HeadMask
from rlkv._io import atomic_write_text
from rlkv.inference import CompressionConfig, make_cache

ATTN_SHAPE = dict(
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=1024, intermediate_size=1024
)
SMALL_SHAPE = dict(
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, hidden_size=256, intermediate_size=512
)
CAP_BYTES = 8 * 2**30
LLAMA8B_KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16

TARGETS = {
    "memory": "resident bytes / analytic <= 1.01 in every mode",
    "decode": "head-mixed s=0.5 / full <= 0.6 at 16K; head-mixed s=0 within 5% of stock sdpa",
    "attention": "decode attention time, head-mixed s=0.5 / full <= 0.55 at 16K",
    "overhead": "rkv scoring amortised <= 10% of a decode step (budget 1024, buffer 128)",
    "train": "gated train step / plain <= 1.5 at 4K",
}


# ---------------------------------------------------------------------------------------- setup
def build_model(shape: dict, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A random Llama of the given attention shape (eval mode, frozen)."""
    config = LlamaConfig(
        num_hidden_layers=layers, vocab_size=512, max_position_embeddings=65536, rope_theta=500000.0, **shape
    )
    config.name_or_path = (
        f"bench-llama-{layers}L-{shape['num_attention_heads']}h-{shape['num_key_value_heads']}kv"
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def random_mask(model, seed: int = 0) -> HeadMask:
    return HeadMask.random(model, seed=seed)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds taken by fn() (CUDA events on GPU, perf_counter on CPU)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODES = {
    # name: (sparsity or None for no mask, policy, budget, policy_kwargs)
    "full": (0.0, "streaming", None, {}),
    "head-mixed s=0.2": (0.2, "streaming", None, {}),
    "head-mixed s=0.4": (0.4, "streaming", None, {}),
    "head-mixed s=0.5": (0.5, "streaming", None, {}),
    "head-mixed s=0.6": (0.6, "streaming", None, {}),
    "head-mixed s=0.8": (0.8, "streaming", None, {}),
    "streaming": (None, "streaming", None, {}),
    "rkv b=1024": (None, "rkv", 1024, {}),
    "rpc P=4096": (None, "rpc", None, {}),
    "rlkv+rkv s=0.5": (0.5, "rkv", 1024, {}),
    "rlkv+rpc s=0.5": (0.5, "rpc", None, {}),
}


def compression_for(model, mode: str) -> CompressionConfig:
    sparsity, policy, budget, kwargs = MODES[mode]
    mask = random_mask(model) if sparsity is not None else None
    return CompressionConfig(
        head_mask=mask,
        sparsity=sparsity if sparsity is not None else 1.0,
        policy=policy,
        budget=budget,
        policy_kwargs=dict(kwargs),
        protect_prompt=False,  # the benchmark's context is all "generated": every token is evictable
    )


# --------------------------------------------------------------------------------------- memory
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
                model(input_ids=ids, past_key_values=cache, use_cache=True)
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
        cmd = [
            sys.executable,
            __file__,
            "--worker",
            "memory",
            "--mode",
            mode,
            "--device",
            args.device,
            "--lengths",
            ",".join(map(str, args.mem_lengths)),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"memory worker {mode!r} failed:\n{out.stderr[-3000:]}")
        res = json.loads(out.stdout.strip().splitlines()[-1])
        results += res["rows"]
        peaks[mode] = res["peak_extra_bytes"]
        print(f"  memory: {mode} done", flush=True)
    worst = max(r["ratio_vs_analytic"] for r in results)
    return dict(rows=results, peak_extra_bytes=peaks, worst_ratio_vs_analytic=worst, passed=worst <= 1.01)


# --------------------------------------------------------------------------------------- decode
def filled_cache(model, mode: str | None, batch: int, length: int, device: str):
    """A cache holding `length` logical tokens of random K/V, already compressed as its mode keeps them.

    Filling through `update` skips a 16K-token prefill (minutes on CPU); the compressed heads are then
    cut to what the policy keeps in steady state (its budget, or sink+window), newest tokens kept.
    """
    cfg = model.config
    shape = (batch, cfg.num_key_value_heads, length, cfg.head_dim)
    if mode is None:
        cache = DynamicCache(config=cfg)
        model.set_attn_implementation("sdpa")
    else:
        cache = make_cache(model, compression_for(model, mode))
    with torch.no_grad():  # one real token first: the cache learns the batch layout (no padding)
        model(
            input_ids=torch.zeros(batch, 1, dtype=torch.long, device=device),
            past_key_values=cache,
            use_cache=True,
        )
    gen = torch.Generator(device="cpu").manual_seed(1)
    for layer in range(cfg.num_hidden_layers):
        k = torch.randn(shape, generator=gen, dtype=model.dtype).to(device)
        # a synthetic fill after the first step: the layer's own update (HeadMixedCache.update refuses a
        # multi-token forward once decoding has started, as a new request on a stale cache)
        cache.layers[layer].update(k, torch.randn(shape, generator=gen, dtype=model.dtype).to(device))
        store = getattr(cache.layers[layer], "store", None)
        if store is not None:
            budget = store.budget
            keep_n = int(budget[0]) if budget is not None else 0
            positions = store.positions
            keep = (positions >= store.logical_length - keep_n) | store.forced_keep()
            store.compact(keep)
    return cache


def run_decode(model, cache, ids: torch.Tensor, steps: int) -> None:
    """`steps` single-token forwards of `ids` [B, 1] against `cache`."""
    with torch.no_grad():
        for _ in range(steps):
            model(input_ids=ids, past_key_values=cache, use_cache=True)


class AttentionTimer:
    """Times every call of the model's registered attention function (a local override of
    transformers' ALL_ATTENTION_FUNCTIONS entry, removed on exit). For the rlkv cache this includes
    the compression check the attention function runs after attending."""

    def __init__(self, model, device: str) -> None:
        self.name, self.device, self.seconds = model.config._attn_implementation, device, 0.0

    def __enter__(self) -> AttentionTimer:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        inner = ALL_ATTENTION_FUNCTIONS[self.name]

        def timed_attention(*args, **kwargs):
            sync(self.device)
            t = time.perf_counter()
            out = inner(*args, **kwargs)
            sync(self.device)
            self.seconds += time.perf_counter() - t
            return out

        ALL_ATTENTION_FUNCTIONS[self.name] = timed_attention
        return self

    def __exit__(self, *exc) -> None:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        del ALL_ATTENTION_FUNCTIONS[self.name]


def decode_step_time(model, cache, batch: int, device: str, steps: int) -> tuple[float, float]:
    """(seconds per decode step, seconds of it in the attention function), averaged over `steps`."""
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    run_decode(model, cache, ids, 2)  # warm-up (the first step also runs the first compression check)
    step = timed(functools.partial(run_decode, model, cache, ids, steps), device) / steps
    with AttentionTimer(model, device) as attention:  # a separate pass: the per-call syncs stay out of `step`
        run_decode(model, cache, ids, steps)
    return step, attention.seconds / steps


def suite_decode(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(ATTN_SHAPE, 2, args.device, dtype)
    modes = [None, "full", "head-mixed s=0.5", "rkv b=1024", "rlkv+rkv s=0.5"]
    rows = []
    for batch in args.batches:
        for length in args.ctx_lengths:
            for mode in modes:
                cache = filled_cache(model, mode, batch, length, args.device)
                t, attn = decode_step_time(model, cache, batch, args.device, args.decode_steps)
                rows.append(
                    dict(
                        mode=mode or "stock sdpa",
                        batch=batch,
                        context=length,
                        seconds_per_step=t,
                        attention_seconds_per_step=attn,
                    )
                )
                del cache
                print(
                    f"  decode: B={batch} ctx={length} {mode or 'stock sdpa'}: {t * 1e3:.1f} ms/step, "
                    f"attention {attn * 1e3:.1f} ms",
                    flush=True,
                )
    by = {(r["mode"], r["batch"], r["context"]): r["seconds_per_step"] for r in rows}
    attn_by = {(r["mode"], r["batch"], r["context"]): r["attention_seconds_per_step"] for r in rows}
    checks = []
    for batch in args.batches:
        for length in args.ctx_lengths:
            full, stock = by[("full", batch, length)], by[("stock sdpa", batch, length)]
            ratio = by[("head-mixed s=0.5", batch, length)] / full
            s0 = full / stock
            key = ("head-mixed s=0.5", batch, length)
            attn_ratio = attn_by[key] / attn_by[("full", batch, length)]
            checks.append(
                dict(
                    batch=batch,
                    context=length,
                    mixed_over_full=ratio,
                    s0_over_stock=s0,
                    attention_mixed_over_full=attn_ratio,
                )
            )
    at16 = [c for c in checks if c["context"] == 16384]
    passed = (
        bool(at16)
        and all(c["mixed_over_full"] <= 0.6 for c in at16)
        and all(c["s0_over_stock"] <= 1.05 for c in checks)
    )
    attention_passed = bool(at16) and all(c["attention_mixed_over_full"] <= 0.55 for c in at16)
    return dict(rows=rows, checks=checks, passed=passed, attention_passed=attention_passed)


# ------------------------------------------------------------------------------------- overhead
class SelectTimer:
    """Wraps one policy object's `select` (our own instance, not a library class) to time compression events."""

    def __init__(self, policy, device: str):
        self.events, self.seconds, self.device = 0, 0.0, device
        inner = policy.select

        def timed_select(store):
            sync(self.device)
            t = time.perf_counter()
            out = inner(store)
            sync(self.device)
            self.seconds += time.perf_counter() - t
            self.events += 1
            return out

        policy.select = timed_select


def suite_overhead(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(ATTN_SHAPE, 2, args.device, dtype)
    policies = {
        "streaming": ("streaming", 1024, {}),
        "rkv": ("rkv", 1024, {"buffer": 128}),
        "snapkv": ("snapkv", 1024, {"buffer": 128}),
        "h2o": ("h2o", 1024, {}),
        "rpc (P=256)": ("rpc", None, {"interval": 256}),
    }
    steps, rows = args.overhead_steps, []
    for label, (name, budget, kwargs) in policies.items():
        config = CompressionConfig(
            sparsity=1.0, policy=name, budget=budget, policy_kwargs=kwargs, protect_prompt=False
        )
        cache = make_cache(model, config)
        timer = SelectTimer(cache.policy, args.device)
        ids = torch.randint(0, 512, (1, 1024), device=args.device)
        with torch.no_grad():
            model(input_ids=ids, past_key_values=cache, use_cache=True)  # prefill 1024
            one = ids[:, :1]
            timer.events, timer.seconds = 0, 0.0
            total = timed(functools.partial(run_decode, model, cache, one, steps), args.device)
        step = total / steps
        per_event = timer.seconds / max(timer.events, 1)
        amortised = timer.seconds / steps
        rows.append(
            dict(
                policy=label,
                steps=steps,
                events=timer.events,
                seconds_per_event=per_event,
                amortised_seconds_per_token=amortised,
                decode_step_seconds=step,
                amortised_fraction_of_step=amortised / step,
            )
        )
        print(
            f"  overhead: {label}: {timer.events} events, {per_event * 1e3:.1f} ms/event, "
            f"{amortised / step:.1%} of a step",
            flush=True,
        )
    rkv = next(r for r in rows if r["policy"] == "rkv")
    return dict(rows=rows, passed=rkv["amortised_fraction_of_step"] <= 0.10)


# ---------------------------------------------------------------------------------------- train
def suite_train(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    plain = build_model(ATTN_SHAPE, 1, args.device, dtype)
    gated = build_model(ATTN_SHAPE, 1, args.device, dtype)
    gated.config = LlamaConfig.from_dict(gated.config.to_dict())  # own config: attach_gates switches it
    rlkv.attach_gates(gated, sink=128, local=256, init=0.5)
    plain.train(), gated.train()

    def step(model, length):
        # weights frozen in both: the backward runs through every layer to the inputs (and the gates)
        emb = torch.randn(
            1, length, ATTN_SHAPE["hidden_size"], device=args.device, dtype=dtype, requires_grad=True
        )
        return timed(lambda: model(inputs_embeds=emb).logits.float().pow(2).mean().backward(), args.device)

    rows = []
    for length in args.train_lengths:
        step(plain, length), step(gated, length)
        tp = min(step(plain, length) for _ in range(2))
        tg = min(step(gated, length) for _ in range(2))
        rows.append(dict(length=length, plain_seconds=tp, gated_seconds=tg, ratio=tg / tp))
        print(f"  train: T={length}: plain {tp:.2f}s gated {tg:.2f}s ratio {tg / tp:.2f}", flush=True)
    at4k = [r for r in rows if r["length"] == 4096]
    return dict(rows=rows, passed=bool(at4k) and at4k[0]["ratio"] <= 1.5)


# ------------------------------------------------------------------------------------- maxbatch
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


# -------------------------------------------------------------------------------------- report
def gib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def report(results: dict) -> str:
    lines = bench_real.report_real(results["real"]) + [""] if "real" in results else []
    if "serve" in results:
        lines += bench_serve.report_serve(results["serve"])
    if "memory" in results:
        m = results["memory"]
        lines += [
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
        lines += [
            "",
            f"worst resident/analytic = {m['worst_ratio_vs_analytic']:.4f}  "
            f"[{'PASS' if m['passed'] else 'FAIL'}: {TARGETS['memory']}]",
            "",
        ]
    if "maxbatch" in results:
        lines += [
            "## Max batch under 8 GiB of KV (Llama-3.1-8B geometry, bf16, measured ratios)",
            "",
            "| mode | length | per sequence | max batch | vs full |",
            "|---|---|---|---|---|",
        ]
        for r in results["maxbatch"]["rows"]:
            lines.append(
                f"| {r['mode']} | {r['length']} | {gib(r['llama8b_bytes_per_sequence'])} | {r['max_batch']} | "
                f"{r['max_batch_vs_full']:.1f}x |"
            )
        lines.append("")
    if "decode" in results:
        d = results["decode"]
        lines += [
            "## Decode time per token (Llama-3.1-8B attention dims, 2 layers)",
            "",
            "| batch | context | mode | ms/step | of which attention, ms |",
            "|---|---|---|---|---|",
        ]
        for r in d["rows"]:
            lines.append(
                f"| {r['batch']} | {r['context']} | {r['mode']} | {r['seconds_per_step'] * 1e3:.2f} | "
                f"{r['attention_seconds_per_step'] * 1e3:.2f} |"
            )
        lines += [
            "",
            "| batch | context | head-mixed s=0.5 / full | attention only: s=0.5 / full | s=0 / stock sdpa |",
            "|---|---|---|---|---|",
        ]
        for c in d["checks"]:
            lines.append(
                f"| {c['batch']} | {c['context']} | {c['mixed_over_full']:.3f} | "
                f"{c['attention_mixed_over_full']:.3f} | {c['s0_over_stock']:.3f} |"
            )
        lines += [
            "",
            f"[{'PASS' if d['passed'] else 'FAIL'}: {TARGETS['decode']}]",
            f"[{'PASS' if d['attention_passed'] else 'FAIL'}: {TARGETS['attention']}]",
            "",
        ]
    if "overhead" in results:
        o = results["overhead"]
        lines += [
            "## Compression overhead (budget 1024, all heads, context 1024 + decode)",
            "",
            "| policy | events | ms/event | amortised ms/token | share of a decode step |",
            "|---|---|---|---|---|",
        ]
        for r in o["rows"]:
            lines.append(
                f"| {r['policy']} | {r['events']} | {r['seconds_per_event'] * 1e3:.2f} | "
                f"{r['amortised_seconds_per_token'] * 1e3:.3f} | {r['amortised_fraction_of_step']:.1%} |"
            )
        lines += ["", f"[{'PASS' if o['passed'] else 'FAIL'}: {TARGETS['overhead']}]", ""]
    if "train" in results:
        t = results["train"]
        lines += [
            "## Training step (forward + backward, 1 layer, Llama-3.1-8B attention dims)",
            "",
            "| T | plain s | gated s | ratio |",
            "|---|---|---|---|",
        ]
        for r in t["rows"]:
            lines.append(
                f"| {r['length']} | {r['plain_seconds']:.2f} | {r['gated_seconds']:.2f} | {r['ratio']:.2f} |"
            )
        lines += ["", f"[{'PASS' if t['passed'] else 'FAIL'}: {TARGETS['train']}]", ""]
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
    if "serve" in results and (
        serve_png := bench_serve.plot_serve(results["serve"], out / "bench_serve.png")
    ):
        written.append(serve_png)
    fig.tight_layout()
    path = out / "bench.png"
    fig.savefig(path, dpi=110)
    written.append(str(path))
    return written


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--suite",
        default="all",
        help="comma list of memory,decode,overhead,train,maxbatch or all; real (needs --model) runs a real "
        "LLM; serve: throughput at a fixed KV cap (--model, or a synthetic model)",
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
    args = parser.parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    if args.worker == "memory":
        print(json.dumps(memory_worker(args.mode, parse_ints(args.lengths), args.device, chunk=256)))
        return 0

    args.mem_lengths = [2048, 4096, 8192, 16384] + ([32768] if args.long else [])
    args.ctx_lengths = [1024, 4096, 16384] + ([32768] if args.long else [])
    args.batches = [1, 8]
    args.decode_steps = 8
    args.overhead_steps = 300
    args.train_lengths = [2048, 4096] + ([8192] if args.long else [])
    if args.quick:
        args.mem_lengths, args.ctx_lengths, args.batches = [512, 1024], [256, 1024], [1, 2]
        args.decode_steps, args.overhead_steps, args.train_lengths = 2, 140, [512]
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
    verdicts = [results[s]["passed"] for s in suites if "passed" in results.get(s, {})]
    print(f"targets: {sum(verdicts)} PASS, {len(verdicts) - sum(verdicts)} FAIL")
    return 0


if __name__ == "__main__":
    sys.exit(main())
