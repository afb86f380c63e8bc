"""The train suite of `python -m benchmarks`: a forward + backward step of a gated model against the plain one."""

from __future__ import annotations

import torch
from transformers import LlamaConfig

import rlkv
from benchmarks.common import ATTN_SHAPE, TARGETS, build_model, timed


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


def report_train(t: dict) -> list[str]:
    """Markdown lines for the train suite."""
    lines = [
        "## Training step (forward + backward, 1 layer, Llama-3.1-8B attention dims)",
        "",
        "| T | plain s | gated s | ratio |",
        "|---|---|---|---|",
    ]
    for r in t["rows"]:
        lines.append(
            f"| {r['length']} | {r['plain_seconds']:.2f} | {r['gated_seconds']:.2f} | {r['ratio']:.2f} |"
        )
    return lines + ["", f"[{'PASS' if t['passed'] else 'FAIL'}: {TARGETS['train']}]", ""]
