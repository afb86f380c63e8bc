"""The report's figures (matplotlib, imported lazily): accuracy vs sparsity, error modes, common
length, the gate heatmap; `save_figure` writes a PNG atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from rlkv.eval.error_modes import ERROR_MODES
from rlkv.eval.tables import (
    Row,
    _draw_groups,
    _methods,
    accuracy_table,
    common_length_table,
    draw_means,
    error_mode_table,
    format_sparsity,
)


def benchmark_panels(
    rows: list[Row], width: float, height: float = 3.8
) -> tuple[Any, list[tuple[Any, str, list[Row]]]]:
    """One figure with a panel per benchmark (in row order): the figure and (axis, benchmark, its rows)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    benches = list(dict.fromkeys(r["benchmark"] for r in rows)) or ["no rows"]
    fig, axes = plt.subplots(1, len(benches), figsize=(width * len(benches), height), squeeze=False)
    return fig, [(ax, b, [r for r in rows if r["benchmark"] == b]) for ax, b in zip(axes[0], benches)]


class MethodColors:
    """One colour per method across a figure's panels (in first-seen order), so a method reads the
    same in every benchmark's panel even when a panel lacks some methods."""

    def __init__(self) -> None:
        import matplotlib

        # tab10 first (ten clearly different hues), then tab20's light shades for an 11th method on
        self.palette = matplotlib.colormaps["tab10"].colors + matplotlib.colormaps["tab20"].colors[1::2]
        self.assigned: dict[str, Any] = {}

    def __call__(self, method: str) -> Any:
        if method not in self.assigned:
            self.assigned[method] = self.palette[len(self.assigned) % len(self.palette)]
        return self.assigned[method]


def plot_accuracy(rows: list[Row], path: Path) -> list[str]:
    """Accuracy vs sparsity, one line per method, one panel per benchmark (RLKV Figure 5); returns the
    panels' benchmarks."""
    fig, benches = accuracy_figure(rows)
    save_figure(fig, path)
    return benches


def accuracy_figure(rows: list[Row]) -> tuple[Any, list[str]]:
    """The figure `plot_accuracy` saves (open, for the caller to save or close) and its panels' benchmarks."""
    fig, panels = benchmark_panels(rows, 5.0)
    color = MethodColors()
    for ax, bench, bench_rows in panels:
        acc = accuracy_table(bench_rows)
        averaged = {m for members in _draw_groups(acc).values() for m in members}
        shown = {m: v for m, v in acc.items() if m not in averaged}  # one line per averaged group
        for method, by_s in {**shown, **draw_means(acc)}.items():
            if method == "full":
                ax.axhline(100 * by_s[0.0], color="black", linestyle="--", label="full")
                continue
            xs = sorted(by_s)
            ax.plot(xs, [100 * by_s[x] for x in xs], marker="o", label=method, color=color(method))
        ax.set(title=bench, xlabel="sparsity (fraction of KV heads compressed)", ylabel="pass@1 (%)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # per panel: a benchmark may lack some methods
    fig.tight_layout()
    return fig, [bench for _, bench, _ in panels]


def plot_error_modes(rows: list[Row], path: Path) -> list[str]:
    """Stacked error-mode bars per method and sparsity on full-solved problems, one panel per benchmark
    (RLKV Figure 9); returns the panels' benchmarks."""
    fig, panels = benchmark_panels(rows, 6.0, 4.2)
    tables = [error_mode_table(bench_rows) for _, _, bench_rows in panels]
    fig.set_size_inches(max(6.0, 0.6 * max(map(len, tables)) + 2) * len(panels), 4.2)
    for (ax, bench, _), table in zip(panels, tables):
        labels = [f"{m}\ns={format_sparsity(s)}" for m, s in table]
        if not table:
            ax.text(
                0.5,
                0.5,
                "no problem solved by the full model",
                ha="center",
                va="center",
                transform=ax.transAxes,
            )
        bottom = [0.0] * len(labels)
        for mode in ERROR_MODES:
            vals = [100.0 * c[mode] / c["n"] for c in table.values()]
            ax.bar(labels, vals, bottom=bottom, label=mode)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set(ylabel="% of full-solved problems", title=f"error modes: {bench}")
        ax.tick_params(axis="x", labelsize=7, rotation=90)
    panels[-1][0].legend()
    fig.tight_layout()
    save_figure(fig, path)
    return [bench for _, bench, _ in panels]


def plot_common_length(rows: list[Row], path: Path) -> list[str]:
    """Generated length relative to full on the samples both solve, per method vs sparsity, one panel per
    benchmark (RLKV Figure 10); returns the panels' benchmarks."""
    fig, panels = benchmark_panels(rows, 5.5)
    color = MethodColors()
    for ax, bench, bench_rows in panels:
        lengths = common_length_table(bench_rows)
        ax.axhline(1.0, color="black", linestyle="--", label="full")
        for method in _methods(bench_rows):
            xs = [s for m, s in lengths if m == method]
            ax.plot(
                xs,
                [lengths[(method, s)]["method"] / lengths[(method, s)]["full"] for s in xs],
                marker="o",
                label=method,
                color=color(method),
            )
        ax.set(xlabel="sparsity", ylabel="generated tokens / full's", title=f"both solve: {bench}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # per panel: a benchmark may lack some methods
    fig.tight_layout()
    save_figure(fig, path)
    return [bench for _, bench, _ in panels]


def plot_gate_heatmap(scores: Any, path: Path, title: str = "head mask scores") -> None:
    """Heatmap of a head mask's scores [L, H_kv] (RLKV Figure 3)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = [list(map(float, row)) for row in scores.tolist()]
    fig, ax = plt.subplots(figsize=(max(3.0, 0.5 * len(data[0]) + 2), max(3.0, 0.25 * len(data) + 1.5)))
    image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0)
    ax.set(xlabel="KV head", ylabel="layer", title=title)
    fig.colorbar(image, ax=ax)
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig: Any, path: Path) -> None:
    """Save atomically (temp file + rename) and close the figure."""
    import matplotlib.pyplot as plt

    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk leaves no half-written image behind
        raise
    finally:
        plt.close(fig)


def plot_training_curves(history: list[dict[str, Any]], path: Path) -> None:
    """Reward (mean +- std) and gate statistics (mean, min, max) per GRPO step, from a trainer log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row.get("step", i + 1) for i, row in enumerate(history)]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6.5, 5.5), sharex=True)
    reward = [float(row["reward"]) for row in history]
    std = [float(row.get("reward_std", 0.0)) for row in history]
    top.plot(steps, reward, marker="o", label="mean reward")
    top.fill_between(
        steps, [r - s for r, s in zip(reward, std)], [r + s for r, s in zip(reward, std)], alpha=0.2
    )
    top.set(ylabel="reward", title="GRPO on the gates")
    top.legend(loc="best")
    for key, style in (("gates/mean", "-"), ("gates/min", ":"), ("gates/max", ":")):
        if all(key in row for row in history):
            bottom.plot(steps, [float(row[key]) for row in history], style, label=key.split("/")[1])
    bottom.set(xlabel="step", ylabel="gate alpha", ylim=(-0.02, 1.02))
    bottom.legend(loc="best")
    fig.tight_layout()
    save_figure(fig, path)
