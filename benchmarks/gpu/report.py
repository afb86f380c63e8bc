"""The GPU suite's verdicts against issue 38's targets and its markdown report (benchmarks/gpu/runner.py)."""

from __future__ import annotations

import statistics

GPU_TARGETS = {
    "syncs": "host syncs per decode step 0 for every rlkv row (in the forward)",
    "vs_flash": "rlkv s=0.5 tokens/s >= 1.2x plain transformers eager with the flash backend pinned",
    "vs_compile": "rlkv s=0.5 tokens/s >= 1.0x plain transformers with StaticCache + torch.compile",
    "roofline": "rlkv s=0.5 decode step >= 50% of its roofline (weights + resident KV / copy bandwidth)",
}


def _measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "tokens_per_s" in r]


def forward_syncs(row: dict, loop_syncs: float | None) -> float | None:
    """Syncs per step in the row's forward: counted between marks, or (a compiled forward, which has no
    mark) the step's syncs less generate's own loop syncs measured on the eager rows."""
    if row.get("forward_syncs") is not None:
        return row["forward_syncs"]
    if row.get("host_syncs") is None or loop_syncs is None:
        return None
    return max(0.0, row["host_syncs"] - loop_syncs)


def verdicts(summary: dict) -> list[dict]:
    """One dict per target (name, target, measured, verdict PASS / FAIL / N/A) at the first batch."""
    batch = summary["batches"][0]
    rows = [r for r in _measured(summary["rows"]) if r["batch"] == batch]
    by = {r["name"]: r for r in rows}
    loops = [r["loop_syncs"] for r in rows if r.get("loop_syncs") is not None]
    loop = statistics.median(loops) if loops else None
    out = []

    rlkv_syncs = {r["name"]: forward_syncs(r, loop) for r in rows if r["policy"] is not None}
    counted = {k: v for k, v in rlkv_syncs.items() if v is not None}
    if counted:
        worst = max(counted, key=counted.get)
        measured = f"worst {counted[worst]:.2f} ({worst}); {len(counted)} rows counted"
        out.append(_verdict("syncs", measured, all(v == 0 for v in counted.values())))
    else:
        out.append(_verdict("syncs", "not counted (no CUDA profile)", None))

    s05 = [r for name, r in by.items() if name.startswith("rlkv s=0.5 ")]
    best = max(s05, key=lambda r: r["tokens_per_s"]) if s05 else None
    for key, base_name, threshold in (
        ("vs_flash", "plain eager (SDPA flash)", 1.2),
        ("vs_compile", "plain StaticCache + compile", 1.0),
    ):
        base = by.get(base_name)
        if best is None or base is None:
            out.append(_verdict(key, "not measured", None))
            continue
        ratio = best["tokens_per_s"] / base["tokens_per_s"]
        measured = (
            f"{ratio:.2f}x ({best['name']} {best['tokens_per_s']:.0f} vs {base['tokens_per_s']:.0f} tok/s)"
        )
        out.append(_verdict(key, measured, ratio >= threshold))
    if best is None:
        out.append(_verdict("roofline", "not measured", None))
    else:
        measured = (
            f"{best['of_roofline']:.0%} ({best['name']}: "
            f"{best['ms_per_step']:.1f} vs {best['roofline_ms']:.1f} ms)"
        )
        out.append(_verdict("roofline", measured, best["of_roofline"] >= 0.5))
    return out


def _verdict(key: str, measured: str, ok: bool | None) -> dict:
    return dict(
        name=key,
        target=GPU_TARGETS[key],
        measured=measured,
        verdict="N/A" if ok is None else "PASS" if ok else "FAIL",
    )


def _num(value, fmt: str) -> str:
    return "" if value is None else format(value, fmt)


def report_gpu(d: dict) -> list[str]:
    """Markdown lines: the rows table and one [PASS/FAIL/N/A: target] line per target."""
    gib = 2**30
    lines = [
        f"## GPU decode ({d['geometry']} random weights, {d['dtype']}, {d['device']})",
        "",
        f"Prompt {d['prompt']} tokens, up to {d['steps']} new tokens per row (greedy, no EOS); copy bandwidth "
        f"{d['bandwidth_bytes_per_s'] / 1e9:.0f} GB/s; {d['wall_s']:.0f} s of a {d['budget_s']:.0f} s budget.",
        "",
        "| batch | method | status | steps | tok/s | ms/step | launches/step | graph launches/step "
        "| syncs/step (forward / loop) | GPU busy | resident KV GiB (vs full) | peak alloc GiB | roofline ms "
        "| of roofline |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for r in d["rows"]:
        if "tokens_per_s" not in r:
            lines.append(f"| {r['batch']} | {r['name']} | {r['status']} |" + " |" * 11)
            continue
        syncs = ""  # not counted (CPU)
        if r.get("forward_syncs") is not None:
            syncs = f"{r['forward_syncs']:.2f} / {_num(r.get('loop_syncs'), '.2f')}"
        elif r.get("host_syncs") is not None:  # a compiled forward: the whole step's
            syncs = f"{r['host_syncs']:.2f} (step)"
        kv = f"{r['resident_kv_bytes'] / gib:.2f} ({r['kv_vs_full']:.2f})"
        peak = _num(r["peak_allocated_bytes"] / gib if r.get("peak_allocated_bytes") else None, ".1f")
        lines.append(
            f"| {r['batch']} | {r['name']} | {r['status']} | {r['steps']} | {r['tokens_per_s']:.1f} | "
            f"{r['ms_per_step']:.2f} | {_num(r.get('kernel_launches'), '.0f')} | "
            f"{_num(r.get('graph_launches'), '.1f')} | {syncs} | {_num(r.get('gpu_busy'), '.0%')} | {kv} | "
            f"{peak} | {r['roofline_ms']:.2f} | {r['of_roofline']:.0%} |"
        )
    lines.append("")
    for v in d["verdicts"]:
        lines.append(f"[{v['verdict']}: {v['target']}] measured: {v['measured']}")
    return lines + [""]
