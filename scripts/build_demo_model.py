"""Build the embedded demo model: a small Llama (GQA) trained from scratch on the chain task.

    OMP_NUM_THREADS=2 .venv/bin/python scripts/build_demo_model.py --out data/demo-model

Makes a word-level tokenizer offline, trains with AdamW on generated train-split problems (loss on
the solution tokens only), then measures greedy accuracy on held-out test problems with the full KV
cache, with every KV head compressed to sink 16 + local 64 (`rlkv.attach_gates`, alpha 0), and with
one KV head compressed at a time. Writes safetensors, config, tokenizer, `eval.json` and the model
card `README.md` into a temp dir renamed to `--out` at the end. Deterministic for a given seed and
thread count.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rlkv.data.chain_task import (
    BODY_WORDS,
    MAX_STEPS,
    MIN_STEPS,
    NUM_LETTERS,
    chain_problems,
    draw_problem,
    verify_chain,
    vocabulary,
)

PAD, BOS_TURN, EOS = "<|pad|>", "<|im_start|>", "<|im_end|>"
# Issue 8: the demo model must solve >= 90% of held-out problems with the full KV cache.
FULL_KV_TARGET = 0.9
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass
class BuildConfig:
    """What the build trains and measures (defaults: the shipped model)."""

    seed: int = 0
    layers: int = 4
    hidden: int = 128
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 32
    rope_theta: float = 1e6  # high base: more slowly rotating dims for content matching far back
    intermediate: int = 256
    steps: int = 2400
    batch: int = 16
    lr: float = 3e-3
    warmup: int = 50
    short_body: int = 64  # document words (24 facts + filler) of the first training problems
    short_steps: int = 600
    ramp_steps: int = 600
    init_std: float = 0.08  # with the transformers default 0.02 an earlier version of the task stalled
    weight_decay: float = 0.1
    eval_every: int = 100
    eval_problems: int = 200
    sink: int = 16
    local: int = 64
    threads: int = 2


def build_tokenizer():
    """Word-level tokenizer over the chain task's vocabulary, ChatML chat template, left padding."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [PAD, BOS_TURN, EOS, "[UNK]", "user", "assistant", "system"]
    words += vocabulary()
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}  # dedupe, keep first-seen order
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        unk_token="[UNK]",
        bos_token=None,
        padding_side="left",
        additional_special_tokens=[BOS_TURN],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(cfg: BuildConfig, tok):
    """A randomly initialised fp32 Llama causal LM sized by `cfg`.

    Llama, not Qwen2: transformers 5's AutoTokenizer forces Qwen2Tokenizer (byte-level) on any
    checkpoint whose config says qwen2, which breaks this word-level tokenizer; for llama it keeps
    the saved tokenizer.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=cfg.hidden,
        intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=1024,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        initializer_range=cfg.init_std,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.do_sample = False
    return model


def prompt_text(tok, problem: str) -> str:
    return tok.apply_chat_template(
        [{"role": "user", "content": problem}], tokenize=False, add_generation_prompt=True
    )


def encode_batch(tok, problems) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, labels) [B, T] of prompt + solution + eos, right-padded; labels only on the answer."""
    rows, labels = [], []
    for p in problems:
        prompt_ids = tok(prompt_text(tok, p.problem), add_special_tokens=False)["input_ids"]
        answer_ids = tok(p.solution, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt_ids + answer_ids)
        labels.append([-100] * len(prompt_ids) + answer_ids)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100)
    for i, (r, lb) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        lab[i, : len(lb)] = torch.tensor(lb)
    return ids, mask, lab


def curriculum_body(cfg: BuildConfig, step: int) -> int:
    """Document words per training problem at `step`: `short_body` first, then a linear ramp to the task's."""
    ramp = (step - cfg.short_steps) / max(1, cfg.ramp_steps)
    return round(cfg.short_body + (BODY_WORDS - cfg.short_body) * min(1.0, max(0.0, ramp)))


def train_problems(rng: random.Random, num: int, body_words: int = BODY_WORDS):
    """`num` fresh train-split problems drawn from `rng` (an endless stream, never a held-out problem)."""
    return [draw_problem(rng, "train", body_words=body_words) for _ in range(num)]


def exact_match(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """BoolTensor[B]: every answer token is the argmax under teacher forcing (then greedy decoding reproduces it)."""
    pred = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    return ((pred == target) | (target == -100)).all(dim=1)


@torch.no_grad()
def teacher_forced_accuracy(model, tok, problems, batch: int = 50) -> tuple[float, float]:
    """(whole-solution, per-token) fraction of `problems` the model predicts under teacher forcing.

    The first is the fraction whose whole reference solution is the greedy choice (a lower bound on
    greedy accuracy); the second the fraction of solution tokens predicted right.
    """
    model.eval()
    hits = tokens = right = 0
    for i in range(0, len(problems), batch):
        ids, mask, labels = encode_batch(tok, problems[i : i + batch])
        logits = model(input_ids=ids, attention_mask=mask).logits
        hits += int(exact_match(logits, labels).sum())
        target = labels[:, 1:]
        scored = target != -100
        tokens += int(scored.sum())
        right += int(((logits[:, :-1].argmax(-1) == target) & scored).sum())
    return hits / max(1, len(problems)), right / max(1, tokens)


@torch.no_grad()
def greedy_accuracy(model, tok, problems, batch: int = 200, max_new_tokens: int = 200) -> float:
    """Fraction of `problems` solved by batched greedy decoding (left padding), checked with `verify_chain`."""
    model.eval()
    correct = 0
    for i in range(0, len(problems), batch):
        chunk = problems[i : i + batch]
        enc = tok(
            [prompt_text(tok, p.problem) for p in chunk],
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
        )
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(verify_chain(t, p.answer) for t, p in zip(texts, chunk))
    return correct / max(1, len(problems))


def train(model, tok, cfg: BuildConfig, val_problems) -> list[dict]:
    """AdamW with linear warmup + cosine decay on fresh train problems; returns the periodic validation log."""
    rng = random.Random(f"rlkv-demo-train:{cfg.seed}")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.98),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))

    log = []
    losses, matches = [], []
    for step in tqdm(range(cfg.steps), desc="train", mininterval=30):
        model.train()
        ids, mask, labels = encode_batch(tok, train_problems(rng, cfg.batch, curriculum_body(cfg, step)))
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(out.loss.item())
        matches.append(exact_match(out.logits.detach(), labels).float().mean().item())
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            entry = {
                "step": step + 1,
                "train_loss": round(sum(losses) / len(losses), 5),
                "train_exact_match": round(sum(matches) / len(matches), 4),
            }
            entry["val_exact_match"], entry["val_token_accuracy"] = teacher_forced_accuracy(
                model, tok, val_problems
            )
            losses, matches = [], []
            log.append(entry)
            tqdm.write(json.dumps(entry))
    return log


def compressed_kv_eval(model, tok, cfg: BuildConfig, problems) -> dict:
    """Greedy accuracy with every KV head at sink+local, then with one KV head at a time (the rest full)."""
    from rlkv import attach_gates, detach_gates

    gates = attach_gates(model, sink=cfg.sink, local=cfg.local, init=0.0)
    try:
        all_heads = greedy_accuracy(model, tok, problems)
        print(f"all heads sink{cfg.sink}+local{cfg.local}: {all_heads:.3f}")
        layers, kv_heads = gates.alpha.shape
        single = [[0.0] * kv_heads for _ in range(layers)]
        for layer in range(layers):
            for head in range(kv_heads):
                gates.alpha.data.fill_(1.0)
                gates.alpha.data[layer, head] = 0.0
                single[layer][head] = greedy_accuracy(model, tok, problems)
                print(f"only KV head (layer {layer}, head {head}) compressed: {single[layer][head]:.3f}")
    finally:
        detach_gates(model)
    return {"all_heads_compressed": all_heads, "single_head_compressed": single}


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
        f"Prompt: a header, then a document of filler words with {2 * NUM_LETTERS} one-word facts scattered through it:",
        f"for each of {NUM_LETTERS} letters its digit (`k=7`) and its successor (`k>m`; the successors form one cycle",
        "through the letters), then `; start X end Y .`. Solution: the start letter, then for each letter of the walk",
        f"from start to end ({MIN_STEPS}-{MAX_STEPS} letters) its digit fact and successor fact copied from the document,",
        "the end letter's digit fact, `\\boxed{d}` and eos. With the chat template, prompt + solution are 311-317",
        "tokens; most facts the solution copies lie more than sink 16 + local 64 tokens back.",
        f"Curriculum: the first `short_steps` steps use documents of `short_body` words (instead of {BODY_WORDS}), then",
        "the document length ramps linearly to the task's over `ramp_steps`.",
        "Training problems are drawn fresh every step from the train split; evaluation uses",
        "`load_chain_task('test', num, seed)`; the splits are disjoint by a hash of the problem text.",
        "",
        "## Architecture and tokenizer",
        "",
        f"Llama, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['heads']} query heads, {cfg['kv_heads']} KV heads (GQA),",
        f"head dim {cfg['head_dim']}, MLP {cfg['intermediate']}, tied embeddings, RoPE theta {cfg['rope_theta']:g},",
        f"max positions 1024, fp32, {report['parameters']:,} parameters. Word-level tokenizer ({report['vocab_size']} tokens,",
        "whitespace split), ChatML chat template, left padding, eos `<|im_end|>`, pad `<|pad|>`.",
        "",
        "## Training",
        "",
        f"AdamW (betas 0.9/0.98, weight decay {cfg['weight_decay']}), lr {cfg['lr']} with {cfg['warmup']} warmup steps",
        f"and cosine decay to 5%, gradient clip 1.0, batch {cfg['batch']}, {cfg['steps']} steps, loss on solution +",
        f"eos tokens only, seed {cfg['seed']}, {cfg['threads']} CPU thread(s). Training took",
        f"{report['train_wall_s'] / 60:.1f} min, the whole build {report['total_wall_s'] / 60:.1f} min (2-core machine).",
        "",
        "## Measured accuracy",
        "",
        f"Greedy decoding, batched with left padding, on {n} held-out test problems (`load_chain_task('test', {n}, {cfg['seed']})`):",
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
            f"**Status: not fit for purpose.** Full-KV accuracy {full:.3f} is below the {FULL_KV_TARGET:.0%} target, so the",
            "compressed-KV numbers above carry no signal about which heads matter. In this build's step budget",
            "the model learned the solution format and the local copies but not yet the long-range lookup",
            "(see the training log); it needs more training steps (see the rlkv issue 8 report).",
        ]
    lines += [
        "",
        "Training log (teacher forcing on 100 validation problems: exact match of whole solutions, per-token accuracy):",
        "",
        "```",
    ]
    lines += [json.dumps(entry) for entry in report["train_log"]]
    lines += [
        "```",
        "",
        "Rebuild: `OMP_NUM_THREADS=2 .venv/bin/python scripts/build_demo_model.py --out data/demo-model`.",
        "",
    ]
    return "\n".join(lines)


def save_atomically(model, tok, out: Path, card: str, report: dict) -> None:
    """Write model, tokenizer, eval.json and README.md to a temp dir beside `out`, then swap it into place."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; this is a shipped artifact
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "README.md").write_text(card)
        old = out.with_name(f".{out.name}.old")
        if out.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/demo-model")
    for field, value in asdict(BuildConfig()).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--skip-sweep", action="store_true", help="skip the compressed-KV evaluations")
    args = parser.parse_args(argv)
    cfg = BuildConfig(**{k: getattr(args, k) for k in asdict(BuildConfig())})
    torch.set_num_threads(cfg.threads)
    t0 = time.time()

    tok = build_tokenizer()
    model = build_model(cfg, tok)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.3f}M parameters; config {asdict(cfg)}")
    val_problems = chain_problems("validation", 100, cfg.seed)
    log = train(model, tok, cfg, val_problems)
    train_s = time.time() - t0
    print(f"trained in {train_s / 60:.1f} min")

    test_problems = chain_problems("test", cfg.eval_problems, cfg.seed)
    report = {
        "build": asdict(cfg),
        "parameters": n_params,
        "vocab_size": len(tok),
        "train_log": log,
        "train_wall_s": round(train_s, 1),
        "test_problems": len(test_problems),
        "full_kv_accuracy": greedy_accuracy(model, tok, test_problems),
    }
    print(f"full KV greedy accuracy on {len(test_problems)} test problems: {report['full_kv_accuracy']:.3f}")
    if not args.skip_sweep:
        report.update(compressed_kv_eval(model, tok, cfg, test_problems))
    report["total_wall_s"] = round(time.time() - t0, 1)
    save_atomically(model, tok, Path(args.out), model_card(report), report)
    print(f"saved to {args.out} after {report['total_wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
