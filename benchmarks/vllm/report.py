"""The vLLM suite's tables: one row per engine run, then the ratios against stock vLLM with PASS/FAIL."""

from __future__ import annotations

from benchmarks.vllm.dispatch import report_dispatch
from benchmarks.vllm.engines import report_engines
from benchmarks.vllm.padding import report_padding


def report_vllm(result: dict) -> list[str]:
    """Markdown lines of the vLLM section: the parts that ran."""
    lines = report_serving(result) if "rows" in result else ["## vLLM (one run)", ""]
    if "engines" in result:
        lines += report_engines(result["engines"], result["settings"]["model"])
    if "padding" in result:
        lines += report_padding(result["padding"])
    if "dispatch" in result:
        lines += report_dispatch(result["dispatch"])
    return lines


def report_serving(result: dict) -> list[str]:
    """Markdown lines of the serving part."""
    s = result["settings"]
    lines = [
        "## vLLM: stock vLLM vs rlkv's head mask on vLLM (one run)",
        "",
        f"model {s['model']}, {s['vllm_requests']} requests of {s['vllm_prompt']} prompt + {s['vllm_new_tokens']} "
        f"generated tokens (EOS ignored), form {s.get('vllm_form', 'window-only')}, window {s['vllm_window']}; "
        "memory-bound: stock holds "
        f"{s['vllm_bound_rows']} requests at once",
        "",
        "| KV cache | method | tokens/s | requests/min | peak blocks used / pool | peak KV used | peak running | "
        "preemptions | groups | compactions / request |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        if r["kv"] == "reference":
            lines.append(f"| reference | {r['method']} | {r['tokens_per_s']:.1f} | | | | | | | |")
            continue
        lines.append(
            f"| {r['kv']} ({r['kv_bytes'] / 2**20:.0f} MiB) | {r['method']} | {r['tokens_per_s']:.1f} | "
            f"{r['requests_per_min']:.2f} | {r['peak_blocks_used']} / {r['blocks']} | "
            f"{r['peak_blocks_used'] / r['blocks'] * r['kv_bytes'] / 2**20:.0f} MiB | {r['peak_running']} | "
            f"{r['preemptions']} | {r['kv_cache_groups']} | {r.get('compactions_per_request', 0):.0f} |"
        )
    lines += [
        "",
        "| method | KV cache | sparsity | tokens/s vs stock vLLM | target | |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    for c in result["checks"]:
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append(
            f"| {c.get('method', 'rlkv')} | {c['kv']} | {c['sparsity']} | {c['ratio']:.2f}x | >= {c['target']}x | "
            f"{verdict} |"
        )
    return lines + [""]
