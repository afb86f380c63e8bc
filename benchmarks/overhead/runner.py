"""The overhead suite of `python -m benchmarks`: each policy's compression events timed during decode, as a
share of the decode step (budget 1024, every head compressed)."""

from __future__ import annotations

import functools
import time

import torch

from benchmarks.common import ATTN_SHAPE, TARGETS, build_model, run_decode, sync, timed
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig, make_cache


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
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)  # prefill 1024
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


def report_overhead(o: dict) -> list[str]:
    """Markdown lines for the overhead suite."""
    lines = [
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
    return lines + ["", f"[{'PASS' if o['passed'] else 'FAIL'}: {TARGETS['overhead']}]", ""]
