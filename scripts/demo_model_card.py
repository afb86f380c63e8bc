"""The demo model's card (README.md), written by scripts/build_demo_model.py with its measured numbers."""

from __future__ import annotations

import json

from rlkv.data.chain_task import BODY_WORDS, MAX_STEPS, MIN_STEPS, NUM_LETTERS

# Issue 8: the demo model must solve >= 90% of held-out problems with the full KV cache.
FULL_KV_TARGET = 0.9


def model_card(report: dict) -> str:
    """The model card (README.md) of the demo model, with the measured numbers of this build."""
    cfg = report["build"]
    n = report["test_problems"]
    lines = [
        "# rlkv demo model: chain-task Llama",
        "",
        "A tiny Llama causal LM trained from scratch by `scripts/build_demo_model.py` on the synthetic",
        "`chain` task (`rlkv.data.chain_task`). Its reasoning depends on long-range KV: each solution step",
        "copies a fact from far back in the prompt, so compressing the wrong KV heads to sink + local",
        "attention breaks it. It is the embedded default model of `make demo`.",
        "",
        "## Data",
        "",
        (
            f"Prompt: a header, then a document of filler words with {2 * NUM_LETTERS} one-word facts "
            "scattered through it:"
        ),
        f"for each of {NUM_LETTERS} letters its digit (`k=7`) and its successor (`k>m`; the successors form one cycle",
        "through the letters), then `; start X end Y .`. Solution: the start letter, then for each letter of the walk",
        (
            f"from start to end ({MIN_STEPS}-{MAX_STEPS} letters) its digit fact and successor fact "
            "copied from the document,"
        ),
        "the end letter's digit fact, `\\boxed{d}` and eos. With the chat template, prompt + solution are 311-317",
        "tokens; most facts the solution copies lie more than sink 16 + local 64 tokens back.",
        (
            "Curriculum: the first `short_steps` steps use documents of `short_body` words "
            f"(instead of {BODY_WORDS}), then"
        ),
        "the document length ramps linearly to the task's over `ramp_steps`.",
        "Training problems are drawn fresh every step from the train split; evaluation uses",
        "`load_chain_task('test', num, seed)`; the splits are disjoint by a hash of the problem text.",
        "",
        "## Architecture and tokenizer",
        "",
        (
            f"Llama, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} query heads, "
            f"{cfg['kv_heads']} KV heads (GQA),"
        ),
        f"head dim {cfg['head_dim']}, MLP {cfg['intermediate']}, tied embeddings, RoPE theta {cfg['rope_theta']:g},",
        (
            f"max positions 1024, fp32, {report['parameters']:,} parameters. "
            f"Word-level tokenizer ({report['vocab_size']} tokens,"
        ),
        "whitespace split), ChatML chat template, left padding, eos `<|im_end|>`, pad `<|pad|>`.",
        "",
        "## Training",
        "",
        f"AdamW (betas 0.9/0.98, weight decay {cfg['weight_decay']}), lr {cfg['lr']} with {cfg['warmup']} warmup steps",
        f"and cosine decay to 5%, gradient clip 1.0, batch {cfg['batch']}, {cfg['steps']} steps, loss on solution +",
        f"eos tokens only, seed {cfg['seed']}, {cfg['threads']} CPU thread(s). Training took",
        (
            f"{report['train_wall_s'] / 60:.1f} min, the whole build {report['total_wall_s'] / 60:.1f} min "
            "(2-core machine)."
        ),
        "",
        "## Measured accuracy",
        "",
        (
            f"Greedy decoding, batched with left padding, on {n} held-out test problems "
            f"(`load_chain_task('test', {n}, {cfg['seed']})`):"
        ),
        "",
        "| KV cache | accuracy |",
        "| --- | --- |",
        f"| full | {report['full_kv_accuracy']:.3f} |",
    ]
    if "all_heads_compressed" in report:
        single = report["single_head_compressed"]
        flat = [(acc, layer, head) for layer, row in enumerate(single) for head, acc in enumerate(row)]
        lo, hi = min(flat), max(flat)
        lines += [
            f"| every KV head sink {cfg['sink']} + local {cfg['local']} | {report['all_heads_compressed']:.3f} |",
            "",
            f"Single-head sensitivity: one KV head at a time compressed to sink {cfg['sink']} + local {cfg['local']}",
            "(`rlkv.attach_gates(model, sink=16, local=64)`, alpha 0 for that head, 1 for all others):",
            "",
            "| layer | " + " | ".join(f"KV head {h}" for h in range(len(single[0]))) + " |",
            "| --- |" + " --- |" * len(single[0]),
        ]
        lines += [
            f"| {layer} | " + " | ".join(f"{a:.3f}" for a in row) + " |" for layer, row in enumerate(single)
        ]
        lines += [
            "",
            f"Spread: min {lo[0]:.3f} (layer {lo[1]}, head {lo[2]}), max {hi[0]:.3f} (layer {hi[1]}, head {hi[2]}).",
        ]
    full = report["full_kv_accuracy"]
    if full < FULL_KV_TARGET:
        lines += [
            "",
            (
                f"**Status: not fit for purpose.** Full-KV accuracy {full:.3f} is below the "
                f"{FULL_KV_TARGET:.0%} target, so the"
            ),
            "compressed-KV numbers above carry no signal about which heads matter. In this build's step budget",
            "the model learned the solution format and the local copies but not yet the long-range lookup",
            "(see the training log); it needs more training steps (see the rlkv issue 8 report).",
        ]
    lines += [
        "",
        (
            "Training log (teacher forcing on 100 validation problems: "
            "exact match of whole solutions, per-token accuracy):"
        ),
        "",
        "```",
    ]
    lines += [json.dumps(entry) for entry in report["train_log"]]
    lines += [
        "```",
        "",
        "Rebuild: `OMP_NUM_THREADS=2 .venv/bin/python scripts/build_demo_model.py --out assets/demo-model`.",
        "",
    ]
    return "\n".join(lines)
