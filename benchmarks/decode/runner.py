"""The decode suite of `python -m benchmarks`: time per decode step, and of it the attention function's, for
every mode against stock sdpa on a cache pre-filled to each context length."""

from __future__ import annotations

import functools
import time

import torch
from transformers import DynamicCache

from benchmarks.common import ATTN_SHAPE, TARGETS, build_model, compression_for, run_decode, sync, timed
from rlkv.compat import cache_kwargs
from rlkv.inference import make_cache


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
            **cache_kwargs(cache),
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


def decode_step_time(model, cache, batch: int, device: str, steps: int, repeats: int) -> tuple[float, float]:
    """(seconds per decode step, seconds of it in the attention function): each the best of `repeats`
    passes of `steps` steps (noise from other processes only ever adds time). On CUDA the steps run
    with SDPA's cuDNN backend off (flash first): cuDNN builds a graph for every new key length, 41-63 ms
    of host time per step on this suite's 2-layer model, which would be all the suite measured."""
    from benchmarks.gpu.profile import sdpa_backends

    with sdpa_backends("no-cudnn" if device.startswith("cuda") else "default", device):
        return _best_step_times(model, cache, batch, device, steps, repeats)


def _best_step_times(model, cache, batch: int, device: str, steps: int, repeats: int) -> tuple[float, float]:
    ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
    run_decode(model, cache, ids, 2)  # warm-up (the first step also runs the first compression check)
    step = attention = float("inf")
    for _ in range(repeats):
        step = min(step, timed(functools.partial(run_decode, model, cache, ids, steps), device) / steps)
        with AttentionTimer(model, device) as timer:  # a separate pass: the per-call syncs stay out of `step`
            run_decode(model, cache, ids, steps)
        attention = min(attention, timer.seconds / steps)
    return step, attention


def suite_decode(args) -> dict:
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    model = build_model(ATTN_SHAPE, 2, args.device, dtype)
    modes = [None, "full", "head-mixed s=0.5", "rkv b=1024", "rlkv+rkv s=0.5"]
    rows = []
    for batch in args.batches:
        for length in args.ctx_lengths:
            for mode in modes:
                cache = filled_cache(model, mode, batch, length, args.device)
                t, attn = decode_step_time(
                    model, cache, batch, args.device, args.decode_steps, args.decode_repeats
                )
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


def report_decode(d: dict) -> list[str]:
    """Markdown lines for the decode suite."""
    lines = [
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
    return lines + [
        "",
        f"[{'PASS' if d['passed'] else 'FAIL'}: {TARGETS['decode']}]",
        f"[{'PASS' if d['attention_passed'] else 'FAIL'}: {TARGETS['attention']}]",
        "",
    ]
