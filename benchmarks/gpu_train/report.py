"""The markdown section of the gpu-train suite (benchmarks/gpu_train/runner.py) and its targets."""

from __future__ import annotations

TARGETS = {
    "rollout": "gated rollout tokens/s >= 0.8x plain rollout tokens/s (same batch)",
    "step": "GRPO step <= 1.5x (plain rollout + log-prob pass + loss forward/backward)",
    "syncs": "host syncs per gated rollout decode step == 0",
    "memory": "step peak allocated <= --train-memory-gb with activation checkpointing",
}


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.2f}"


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


STEP_ROWS = ["GRPO step s", "rollout s (tok/s)", "no-grad log-prob passes in the step (s)", "loss forward s",
             "backward s", "step peak allocated GiB", "rollout peak allocated GiB"]  # fmt: skip


def _step_cells(step: dict) -> list[str]:
    """The STEP_ROWS cells of one step's parts ("skipped" throughout for a skipped step)."""
    if "skipped" in step:
        return ["skipped"] * len(STEP_ROWS)
    rollout = step["rollout"]
    return [
        f"{step['step_seconds']:.2f}",
        f"{rollout['seconds']:.2f} ({rollout['tokens_per_second']:.0f})",
        f"{step['logps_passes']} ({step['logps_seconds']:.2f})",
        f"{step['loss_forward_seconds']:.2f}",
        f"{step['backward_seconds']:.2f}",
        _gib(step["step_peak_bytes"]),
        _gib(rollout["peak_bytes"]),
    ]


def _compressed_sentence(c: dict) -> str:
    if "skipped" in c:
        return f"Compressed-rollout step {c['skipped']}."
    ratio = "/".join(_ratio(c["importance_sampling_ratio"][s]) for s in ("min", "mean", "max"))
    return (
        f"Compressed rollouts: resident KV {c['resident_kv_bytes'] / 2**20:.2f} MiB of "
        f"{c['full_kv_bytes'] / 2**20:.2f} MiB full (peak {c['peak_kv_bytes'] / 2**20:.2f}), "
        f"importance-sampling ratio {ratio} (min/mean/max)."
    )


def report_gpu_train(r: dict) -> list[str]:
    """Markdown lines for the gpu-train suite."""
    g, p, c = r["gated"], r["plain"], r["compressed"]
    geo = r["geometry"]
    lowered = r["tokens"] < r["tokens_requested"]
    lines = [
        f"## GRPO gate-training step on one device ({r['device_name']}, {r['dtype']}, torch {r['torch']})",
        "",
        f"Random weights, {geo['num_hidden_layers']} layers, {geo['num_attention_heads']} q / "
        f"{geo['num_key_value_heads']} kv heads, hidden {geo['hidden_size']}, vocab {geo['vocab_size']}; "
        f"{r['prompts']} prompts x {r['generations']} completions x {r['tokens']} tokens"
        + (f" (requested {r['tokens_requested']}, lowered to fit --train-budget-s)" if lowered else "")
        + f"; activation checkpointing; suite {r['wall_seconds']:.0f}s.",
        "",
        f"| part | gated step | compressed-rollout step (s={r['sparsity']:.2g}) |",
        "| --- | ---: | ---: |",
    ]
    for row, gated, compressed in zip(STEP_ROWS, _step_cells(g), _step_cells(c), strict=True):
        lines.append(f"| {row} | {gated} | {compressed} |")
    lines += [
        "",
        f"Side by side: plain rollout {p['rollout']['seconds']:.2f}s ({p['rollout']['tokens_per_second']:.0f} "
        f"tok/s); one no-grad log-prob pass {g['logps_pass_seconds']:.2f}s; step baseline (plain rollout + "
        f"log-prob pass + loss forward + backward) {r['step_baseline_seconds']:.2f}s. {_compressed_sentence(c)}",
        "",
        f"| decode step (batch {r['prompts'] * r['generations']}) | ms | host syncs | kernel launches |",
        "| --- | ---: | ---: | ---: |",
    ]
    probes = [("gated forward (DynamicCache)", g["probe"]), ("plain forward", p["probe"])]
    probes += [] if "skipped" in c else [("compressed forward", c["probe"])]
    loops = [("gated rollout loop (generate)", g["rollout_loop"])]
    loops += [] if "skipped" in c else [("compressed rollout loop (generate)", c["rollout_loop"])]
    for name, probe in probes:
        lines.append(
            f"| {name} | {probe['seconds_per_step'] * 1e3:.1f} | {_count(probe['host_syncs_per_step'])} "
            f"| {_count(probe['kernel_launches_per_step'])} |"
        )
    for name, loop in loops:  # no ms: these short rollouts are for counting
        lines.append(
            f"| {name} | - | {_count(loop['host_syncs_per_step'])} | {_count(loop['kernel_launches_per_step'])} |"
        )
    estimate = r["max_tokens_per_completion_estimate"]
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}
    lines += [
        "",
        f"[{verdict[r['targets']['rollout']]}: {TARGETS['rollout']}: {r['rollout_ratio']:.2f}]",
        f"[{verdict[r['targets']['step']]}: {TARGETS['step']}: {r['step_ratio']:.2f}]",
        f"[{verdict[r['targets']['syncs']]}: {TARGETS['syncs']}: {g['probe']['host_syncs_per_step']:.1f} in the "
        f"forward; the whole rollout loop, generate's per-step checks included: "
        f"{_count(g['rollout_loop']['host_syncs_per_step'])}]",
        f"[{verdict[r['targets']['memory']]}: {TARGETS['memory']}: {_gib(g['step_peak_bytes'])} GiB]",
    ]
    if estimate is not None:
        lines.append(
            f"Largest completion length at {r['prompts'] * r['generations']} completions under the cap "
            f"(linear estimate from this step's peak): ~{estimate} tokens."
        )
    return lines + [""]


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
