"""Training and measuring the demo model (scripts/build_demo_model.py): the build settings, the model,
the AdamW run with its curriculum, and greedy accuracy with full and compressed KV."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import torch
from demo_model_data import encode_batch, prompt_text, train_problems
from tqdm.auto import tqdm

from rlkv.data.chain_task import BODY_WORDS, verify_chain


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


def curriculum_body(cfg: BuildConfig, step: int) -> int:
    """Document words per training problem at `step`: `short_body` first, then a linear ramp to the task's."""
    ramp = (step - cfg.short_steps) / max(1, cfg.ramp_steps)
    return round(cfg.short_body + (BODY_WORDS - cfg.short_body) * min(1.0, max(0.0, ramp)))


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
