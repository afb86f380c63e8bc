"""The serve suite's report (benchmarks/serve/runner.py): the markdown table with its verdicts, and the plot."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from benchmarks.serve.runner import serve_targets


def report_serve(s: dict) -> list[str]:
    """Markdown lines for the serve suite."""
    mib = lambda n: "-" if n is None else f"{n / 2**20:.1f} MiB"  # noqa: E731
    num = lambda x, f=".1f": "-" if x is None else format(x, f)  # noqa: E731
    memory = "peak CUDA allocated" if s["device"].startswith("cuda") else "peak RSS"
    lines = [
        f"## Serving at a fixed KV cap: {os.path.basename(s['model'].rstrip('/'))}, {s['dtype']}, "
        f"cap {s['cap_bytes'] / 2**20:.1f} MiB, {s['new_tokens']} new tokens (EOS suppressed), "
        f"{s['threads']} threads, {s['device']}",
        "",
        "| method | max batch (fits / over) | decode tok/s | whole-run tok/s | peak KV (over: KV when stopped) "
        f"| {memory} | decode vs full | batch vs full |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in s["rows"]:
        over = r["first_over_batch"] if r["first_over_batch"] is not None else "not reached"
        if r.get("status") == "skipped (time limit)":
            lines.append(f"| {r['method']} | {r['status']} |" + " |" * 6)
            continue
        if r.get("status") == "search cut by the time limit":  # the max batch is a lower bound
            over = f"{over} (search cut by the time limit)"
        lines.append(
            f"| {r['method']} | {r['max_batch']} / {over} | {num(r['decode_tokens_per_s'])} | "
            f"{num(r['whole_tokens_per_s'])} | {mib(r['peak_kv_bytes'])} ({mib(r['over_peak_kv_bytes'])}) | "
            f"{mib(r['peak_cuda_bytes'] if s['device'].startswith('cuda') else r['peak_rss_bytes'])} | "
            f"{num(r['decode_vs_full'], '.2f')} | {num(r['max_batch_vs_full'], '.2f')} |"
        )
    lines += ["", "| target | measured | verdict |", "|---|---|---|"]
    for name, ok in s["verdicts"].items():
        key = "rkv b=1024" if name.startswith("rkv") else name
        row = next(r for r in s["rows"] if r["method"] == name)
        lines.append(
            f"| {serve_targets(s['device'])[key][1]} | {num(row['decode_vs_full'], '.2f')} | "
            f"{'PASS' if ok else 'FAIL'} |"
        )
    return lines + [""]


def plot_serve(s: dict, path: Path) -> str | None:
    """tokens/s vs batch per method (each method's max batch marked) and peak KV vs batch (cap marked)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: pip install 'rlkv[plots]' for PNG plots", file=sys.stderr)
        return None
    fig, (ax, ax_kv) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in s["rows"]:
        fits = sorted((p for p in r["probes"] if p["fits"]), key=lambda p: p["batch"])
        line = ax.plot(
            [p["batch"] for p in fits], [p["whole_tokens_per_s"] for p in fits], marker="o", label=r["method"]
        )
        if r["max_batch"]:
            ax.axvline(r["max_batch"], color=line[0].get_color(), ls=":", lw=1)
        probes = sorted(r["probes"], key=lambda p: p["batch"])
        ax_kv.plot(
            [p["batch"] for p in probes],
            [p["peak_kv_bytes"] / 2**20 for p in probes],
            marker="o",
            label=r["method"],
        )
    cap = s["cap_bytes"] / 2**20
    ax_kv.axhline(cap, color="k", ls="--", label=f"cap {cap:.0f} MiB")
    ax.set(
        xscale="log",
        xlabel="batch",
        ylabel="whole-run tokens/s",
        title="tokens/s vs batch (dotted: max batch under the cap)",
    )
    ax_kv.set(xscale="log", xlabel="batch", ylabel="peak resident KV (MiB)", title="KV vs batch")
    batches = sorted({p["batch"] for r in s["rows"] for p in r["probes"]})
    for a in (ax, ax_kv):  # plain integer ticks at the batches probed (log axes print 2x10^0 otherwise)
        a.set_xticks(batches, [str(b) for b in batches])
        a.minorticks_off()
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
