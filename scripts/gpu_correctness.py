"""Correctness of rlkv on a device, on the embedded demo model (assets/demo-model, real weights): host syncs
per decode step for every registered policy, and tokens of plain generate vs rlkv's dynamic and static
caches. Writes a small markdown report.

    python scripts/gpu_correctness.py --device cuda --out runs/gpu_correctness.md     # ~1 min on a GPU
    python scripts/gpu_correctness.py --device cpu --quick --out /tmp/gpu_correctness.md

Host syncs: each policy runs on the compressed heads of a random head mask at s=0.5 (settings that
evict within the run), for a batch of equal-length rows and a left-padded batch; after the prompt
forward, every decode forward is counted: on CUDA the warnings of `torch.cuda.set_sync_debug_mode`
("warn"; "error" would stop at the first), on CPU `rlkv.testing.HostSyncCounter` (the tensor reads that
would sync on CUDA), when it exists. Tokens: 4 prompts, greedy, through `rlkv.inference.generate`:
plain (no compression) vs rlkv at s=0 (must be identical) and the dynamic vs static cache at s=0 and
s=0.5 (static when this rlkv has one).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: benchmarks/
from benchmarks.gpu.profile import HostReads  # noqa: E402
from rlkv import HeadMask  # noqa: E402
from rlkv._io import atomic_write_text  # noqa: E402
from rlkv.compat import cache_kwargs  # noqa: E402
from rlkv.inference import CompressionConfig, generate, load, make_cache  # noqa: E402
from rlkv.policies import available  # noqa: E402

DEMO_MODEL = Path(__file__).resolve().parents[1] / "assets" / "demo-model"
PROMPTS = [
    "What is 17 + 25?",
    "Tom has 3 apples and buys 4 more. How many apples does he have?",
    "Compute 6 * 7, then add 5.",
    "If x + 3 = 10, what is x? Think step by step before answering.",
]
# (cache settings, policy kwargs) under which each policy evicts within a short run; unknown policies
# (registered later) run with their defaults
POLICY_SETTINGS: dict[str, tuple[dict, dict]] = {
    "full": ({}, {}),
    "streaming": ({"sink": 2, "window": 4}, {}),
    "sink-recent": ({"budget": 8, "sink": 2, "window": 2}, {}),
    "rkv": ({"budget": 12, "sink": 2, "window": 2}, {"buffer": 4}),
    # the demo tokenizer has no newline token: sentences end at "."
    "skipkv": ({"budget": 12, "sink": 2, "window": 2}, {"buffer": 4, "delimiters": ["."]}),
    "rpc": ({}, {"interval": 8, "selector_window": 4}),
    "h2o": ({"budget": 8, "sink": 1, "window": 2}, {}),
    "snapkv": ({"budget": 12, "sink": 1, "window": 2}, {"buffer": 4}),
    "knorm": ({"budget": 8, "sink": 1, "window": 2}, {}),
}


class SyncCounter:
    """Counts host syncs in a block: CUDA's sync debug mode on a GPU, HostSyncCounter on CPU."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")
        self.reads = HostReads()
        self.available = self.cuda or self.reads.available

    @contextlib.contextmanager
    def counting(self) -> Iterator[list[int | None]]:
        """Yields a one-element list holding the block's host syncs once it ends (None where nothing
        can count them)."""
        box: list[int | None] = [None]
        if self.cuda:
            torch.cuda.synchronize()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    yield box
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            box[0] = sum("synchroniz" in str(w.message) for w in caught)
        elif self.reads.available:
            with self.reads.count() as reads:
                yield box
            box[0] = reads[0]
        else:
            yield box


def batch_ids(tokenizer, device: str, padded: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [4, T] of PROMPTS: left-padded, or cut to the shortest (no padding)."""
    from rlkv.inference import encode_prompts

    encoded = encode_prompts(tokenizer, PROMPTS)
    width = max(map(len, encoded)) if padded else min(map(len, encoded))
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id or 0, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, e in enumerate(encoded):
        e = e[-width:]
        ids[row, width - len(e) :] = torch.tensor(e)
        mask[row, width - len(e) :] = 1
    return ids.to(device), mask.to(device)


def policy_syncs(model, tokenizer, name: str, device: str, steps: int, counter: SyncCounter) -> dict:
    """Syncs per decode forward of policy `name` on the compressed heads of a random s=0.5 mask:
    mean and max per step, for equal-length and left-padded rows."""
    settings, kwargs = POLICY_SETTINGS.get(name, ({}, {}))
    if name == "skipkv":
        kwargs = dict(kwargs, tokenizer=tokenizer)
    config = CompressionConfig(
        head_mask=HeadMask.random(model, seed=0),
        sparsity=0.5,
        policy=name,
        policy_kwargs=kwargs,
        protect_prompt=False,  # the policies evict during the counted steps, not only after the prompt
        **settings,
    )
    out: dict = dict(policy=name)
    for layout in ("equal", "padded"):
        cache = make_cache(model, config)
        ids, mask = batch_ids(tokenizer, device, padded=layout == "padded")
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.inference_mode():
            logits = model(
                input_ids=ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache)
            ).logits
            counts = []
            for _ in range(steps):
                ids = logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
                step = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
                with counter.counting() as syncs:
                    logits = model(**step, **cache_kwargs(cache)).logits
                counts.append(syncs[0])
        known = [c for c in counts if c is not None]
        out[layout] = (sum(known) / len(known), max(known)) if known else None
    return out


def token_checks(model, tokenizer, new_tokens: int) -> list[dict]:
    """Greedy tokens of the 4 prompts: plain generate vs rlkv s=0, and dynamic vs static caches."""
    has_static = "static_cache" in inspect.signature(generate).parameters
    mask = HeadMask.random(model, seed=0)
    runs: dict[str, list[list[int]] | str] = {}

    def run(label: str, compression: CompressionConfig | None, static: bool | None) -> None:
        extra = {} if static is None else {"static_cache": static}
        if static and not has_static:
            runs[label] = "not available (generate has no static_cache)"
            return
        try:
            out = generate(
                model, tokenizer, PROMPTS, new_tokens, compression=compression, progress=False, **extra
            )
            runs[label] = [o.token_ids for o in out]
        except Exception as e:  # a layout without a static form, or a bug: reported, not fatal
            runs[label] = f"error: {type(e).__name__}: {e}"[:200]

    model.set_attn_implementation("sdpa")
    run("plain generate", None, None)
    for s in (0.0, 0.5):
        config = CompressionConfig(head_mask=mask, sparsity=s, policy="streaming", sink=2, window=8)
        run(f"rlkv s={s} dynamic", config, False if has_static else None)
        run(f"rlkv s={s} static", config, True)
    pairs = [
        ("plain generate", "rlkv s=0.0 dynamic"),
        ("plain generate", "rlkv s=0.0 static"),
        ("rlkv s=0.0 dynamic", "rlkv s=0.0 static"),
        ("rlkv s=0.5 dynamic", "rlkv s=0.5 static"),
    ]
    checks = []
    for a, b in pairs:
        ta, tb = runs[a], runs[b]
        if isinstance(ta, str) or isinstance(tb, str):
            checks.append(dict(a=a, b=b, identical=None, note=ta if isinstance(ta, str) else tb))
            continue
        same = sum(x == y for x, y in zip(ta, tb))
        checks.append(dict(a=a, b=b, identical=same, of=len(ta), note=""))
    return checks


def report(device: str, rows: list[dict], checks: list[dict], counted: bool, seconds: float) -> str:
    """The markdown report."""
    how = "torch.cuda.set_sync_debug_mode warnings" if device.startswith("cuda") else "HostSyncCounter"
    lines = [
        f"## rlkv correctness on {device} (assets/demo-model, {seconds:.0f} s)",
        "",
        f"Host syncs per decode forward (random s=0.5 mask, 4 rows; counted with {how}):",
        "",
        "| policy | equal rows: mean / max per step | left-padded rows: mean / max per step |",
        "|---|---|---|",
    ]
    for r in rows:
        cells = []
        for layout in ("equal", "padded"):
            v = r.get(layout)
            cells.append(r.get("error", "not counted") if v is None else f"{v[0]:.2f} / {v[1]}")
        lines.append(f"| {r['policy']} | {cells[0]} | {cells[1]} |")
    if not counted:
        lines += ["", "(no counter on this device: rlkv.testing.HostSyncCounter is missing)"]
    syncing = [r["policy"] for r in rows if any(r.get(k) and r[k][1] > 0 for k in ("equal", "padded"))]
    verdict = "N/A" if not counted else "FAIL" if syncing or any("error" in r for r in rows) else "PASS"
    lines += ["", f"[{verdict}: 0 host syncs per decode step for every registered policy]"]
    if syncing:
        lines.append(f"policies that sync: {', '.join(syncing)}")
    lines += ["", "Greedy tokens, 4 prompts:", "", "| compared | identical prompts |", "|---|---|"]
    for c in checks:
        cell = c["note"] if c["identical"] is None else f"{c['identical']} of {c['of']}"
        lines.append(f"| {c['a']} vs {c['b']} | {cell} |")
    if not checks:
        lines.append("| (the comparisons had not finished) | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--model", default=str(DEMO_MODEL))
    parser.add_argument("--dtype", default="float32", help="float32 keeps token comparisons exact")
    parser.add_argument("--steps", type=int, default=24, help="decode steps counted per policy and layout")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per prompt in the comparisons")
    parser.add_argument("--quick", action="store_true", help="8 steps, 12 tokens (a CPU smoke run)")
    parser.add_argument("--out", default="runs/gpu_correctness.md")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.new_tokens = min(args.steps, 8), min(args.new_tokens, 12)
    started = time.perf_counter()
    model, tokenizer = load(args.model, dtype=args.dtype, device=args.device)
    counter = SyncCounter(args.device)
    rows = []
    for name in available():
        try:
            rows.append(policy_syncs(model, tokenizer, name, args.device, args.steps, counter))
        except Exception as e:  # reported in the table: the other policies still run
            traceback.print_exc()
            rows.append(dict(policy=name, error=f"error: {type(e).__name__}: {e}"[:200]))
        print(f"  correctness: {rows[-1]}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # the sync table first: a run killed during the (compiled) token comparisons still leaves it
    atomic_write_text(
        Path(args.out), report(args.device, rows, [], counter.available, time.perf_counter() - started)
    )
    checks = token_checks(model, tokenizer, args.new_tokens)
    text = report(args.device, rows, checks, counter.available, time.perf_counter() - started)
    print(text)
    atomic_write_text(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
