"""Head sensitivity (RLKV Figure 7): accuracy as heads are compressed progressively in a given order.

`HeadMask.full_heads(s)` compresses the round(s * N) lowest-scoring heads, and these sets are nested
as s grows, so evaluating a mask method at the fractions k / N *is* compressing heads one by one
in that mask's order: `rlkv` = gate order, `ablation-mask` = per-head ablation order (`rlkv
ablation-mask`), `random-mask` = a random order, `duo` = another mask's order (e.g. DuoAttention
retrieval heads). `HeadMask.from_order` turns any explicit order into a mask.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rlkv.deprecation import moved_names
from rlkv.eval.plots import benchmark_panels, save_figure
from rlkv.eval.tables import accuracy_table
from rlkv.head_mask import HeadMask

ORDER_METHODS = ("rlkv", "ablation-mask", "random-mask", "duo")
ORDER_LABELS = {
    "rlkv": "gate order",
    "ablation-mask": "ablation order",
    "random-mask": "random order",
    "duo": "other mask's order",
}


# deprecated names of this module, removed in 0.3
__getattr__ = moved_names(
    __name__,
    {"mask_from_order": (lambda: HeadMask.from_order, "rlkv.HeadMask.from_order(order, model, **metadata)")},
)


def sensitivity_fractions(num_heads: int, steps: int | None = None) -> list[float]:
    """Fractions of heads compressed: every k / N (steps=None) or `steps` + 1 evenly spaced whole-head counts."""
    counts = (
        range(num_heads + 1)
        if steps is None
        else sorted({round(i * num_heads / steps) for i in range(steps + 1)})
    )
    return [k / num_heads for k in counts]


def sensitivity_methods(cfg: Any) -> list[str]:
    """The methods of `cfg`'s sweep: full and each order method whose mask is set (`random-mask` always, which
    also runs the s = 1.0 end)."""
    from rlkv.eval.methods import MASK_FIELDS

    return ["full"] + [m for m in ORDER_METHODS if m == "random-mask" or getattr(cfg, MASK_FIELDS[m])]


def sensitivity_configs(cfg: Any, num_heads: int, steps: int | None = None) -> tuple[Any, Any]:
    """The sweep of `cfg` as two `EvalConfig` runs into `<cfg.out>/sensitivity`.

    1. full + each order method it can run at the fractions strictly between 0 and 1 (`random-mask`
       always; `rlkv`, `ablation-mask` and `duo` when their mask field is set);
    2. `random-mask` at 1.0: every head compressed is one cache whatever the order, so it runs once,
       as s = 0 is full KV for every order (`sensitivity_curves` puts both ends on each curve).
    """
    methods = sensitivity_methods(cfg)
    inner = [s for s in sensitivity_fractions(num_heads, steps) if 0.0 < s < 1.0]
    if not inner:
        from rlkv.errors import UserInputError

        raise UserInputError(
            f"--sensitivity {steps}: no fraction of heads between 0 and 1 to sweep; give >= 2 steps"
        )
    out = str(Path(cfg.out) / "sensitivity")
    return (
        dataclasses.replace(cfg, methods=methods, sparsities=inner, out=out),
        dataclasses.replace(cfg, methods=["random-mask"], sparsities=[1.0], out=out),
    )


def sensitivity_curves(rows: list[dict[str, Any]]) -> dict[str, dict[float, float]]:
    """Each order method's pass@1 by fraction of heads compressed, ascending, with the shared ends: full
    KV's at 0 and every-head-compressed's (whichever order ran it) at 1."""
    acc = accuracy_table(rows)
    ends = {0.0: acc["full"][0.0]} if "full" in acc else {}
    every = [by_s[1.0] for m, by_s in acc.items() if m in ORDER_METHODS and 1.0 in by_s]
    if every:
        ends[1.0] = every[0]
    return {m: dict(sorted({**ends, **by_s}.items())) for m, by_s in acc.items() if m in ORDER_METHODS}


def plot_sensitivity(rows: list[dict[str, Any]], path: str | os.PathLike) -> list[str]:
    """Accuracy vs fraction of heads compressed, one line per order, one panel per benchmark (RLKV Figure 7);
    returns the panels' benchmarks."""
    fig, panels = benchmark_panels(rows, 5.5)
    for ax, bench, bench_rows in panels:
        acc = accuracy_table(bench_rows)
        if "full" in acc:
            ax.axhline(100 * acc["full"][0.0], color="black", linestyle="--", label="full")
        for method, by_s in sensitivity_curves(bench_rows).items():
            # one colour per order, the same in every panel
            color = f"C{ORDER_METHODS.index(method)}"
            ax.plot(
                list(by_s),
                [100 * v for v in by_s.values()],
                marker="o",
                color=color,
                label=ORDER_LABELS[method],
            )
        ax.set(
            xlabel="fraction of KV heads compressed", ylabel="pass@1 (%)", title=f"head sensitivity: {bench}"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)  # per panel: a benchmark may lack some orders
    fig.tight_layout()
    save_figure(fig, Path(path))
    return [bench for _, bench, _ in panels]
