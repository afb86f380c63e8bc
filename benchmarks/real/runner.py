"""Real-model CPU benchmark: gated generation and GRPO gate-training steps on a real LLM.

    python -m benchmarks --suite real --model models/qwen2.5-coder-0.5b-instruct --out runs/bench-real
    python -m benchmarks.real.runner --worker step --model M --completions 32   # one measurement alone (JSON)
    python -m benchmarks.real.runner --worker inference --model M              # the decode comparison alone

Each measurement runs in its own process (clean peak RSS: the high-water mark is reset after the
model is loaded), side by side in one run, and the suite prints ratios with PASS/FAIL:
- gated `generate` tokens/s / plain `generate` tokens/s, same batch, dtype, sampling (>= 0.8);
- inference: batch-1 greedy decoding after a 512-token prompt, rlkv's head-mixed cache at s=0.5
  (the shipped mask, dynamic and static eager) tokens/s / plain transformers' (>= 1.0);
- one GRPO step of `GateGRPOTrainer` / (plain generate time + one forward+backward of the plain
  model over the same sequences, backward to the inputs) (<= 1.5);
- peak RSS of that step (<= 4 GiB for 8 completions x 256 tokens in bf16) and how busy the cores
  were (CPU seconds / wall seconds / cores, >= 0.75);
- bf16 / fp32 step time at a smaller setting (reported).
Completions always run to the token limit (EOS suppressed by `min_new_tokens`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from transformers.generation import BaseStreamer

from benchmarks.common import ROOT, child_env, module_command
from rlkv.cli import positive_int
from rlkv.inference import load

GATE_SINK, GATE_LOCAL = 16, 64
TARGETS = {
    "generate": "gated generate tokens/s / plain >= 0.8",
    "step": "GRPO step / (plain generate + forward+backward) <= 1.5",
    "rss": "peak RSS of the step <= 4 GiB (8 x 256, bf16)",
    "cpu": "cores busy during the step: CPU s / wall s / cores >= 0.75",
    "inference": "batch 1, prompt 512, 128 new tokens: rlkv s=0.5 tokens/s / plain >= 1.0, dynamic and static",
}
QUESTIONS = [
    "A shop sells pencils at {a} cents each. How much do {b} pencils cost in dollars?",
    "What is {a} * {b} - {a}? Show your steps.",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "Sum the integers from {b} to {a}.",
]


def prompts(tokenizer, n: int) -> list[str]:
    """n chat-templated math questions (deterministic)."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)].format(a=37 + 11 * i, b=3 + i)
        messages = [{"role": "user", "content": q + " Put the final answer in \\boxed{}."}]
        out.append(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    return out


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def reset_peak_rss() -> None:
    """Reset the kernel's resident-set high-water mark of this process (Linux; no-op elsewhere)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss_bytes() -> int:
    """VmHWM of this process (bytes) since the last reset."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


class Meter:
    """Wall seconds, CPU utilisation (per core) and peak RSS of a block."""

    def __enter__(self):
        reset_peak_rss()
        self.t, self.cpu = time.perf_counter(), os.times()
        return self

    def __exit__(self, *exc):
        wall = time.perf_counter() - self.t
        now = os.times()
        cpu = (now.user - self.cpu.user) + (now.system - self.cpu.system)
        self.result = dict(seconds=wall, cpu_util=cpu / wall / cores(), peak_rss=peak_rss_bytes())


def encode(tok, texts: list[str]):
    return tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)


def sample(model, tok, enc, new_tokens: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    with torch.no_grad():
        return model.generate(
            **enc,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            pad_token_id=tok.pad_token_id,
        )


def worker_generate(args) -> dict:
    """Plain vs gated generate (alternating, best of two each), then plain forward+backward."""
    import rlkv
    from rlkv.trainers.logprobs import token_logps

    model, tok = load(args.model, dtype=args.dtype)
    enc = encode(tok, prompts(tok, args.completions))
    torch.manual_seed(0)
    alpha = torch.rand(model.config.num_hidden_layers, model.config.num_key_value_heads)

    def gated(fn):
        gates = rlkv.attach_gates(model, sink=GATE_SINK, local=GATE_LOCAL)
        with torch.no_grad():
            gates.alpha.copy_(alpha)
        try:
            return fn()
        finally:
            rlkv.detach_gates(model)

    sample(model, tok, enc, 4), gated(lambda: sample(model, tok, enc, 4))  # warm up kernels
    plain_s, gated_s, seqs = [], [], None
    for _ in range(2):
        with Meter() as m:
            seqs = sample(model, tok, enc, args.new_tokens)
        plain_s.append(m.result["seconds"])
        with Meter() as m:
            gated(lambda: sample(model, tok, enc, args.new_tokens))
        gated_s.append(m.result["seconds"])
    tokens = args.completions * args.new_tokens

    mask = torch.cat([enc["attention_mask"], torch.ones(seqs.shape[0], args.new_tokens, dtype=torch.long)], 1)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    for p in model.parameters():
        p.requires_grad_(False)
    rlkv.gates.contiguous_head_inputs(model)  # as attach_gates does: the frozen head's fast path
    model.train()

    def forward_backward():
        for rows in torch.split(torch.arange(seqs.shape[0]), args.micro_batch):
            emb = embed(seqs[rows]).detach().requires_grad_()
            out = model(
                inputs_embeds=emb, attention_mask=mask[rows], output_hidden_states=True, logits_to_keep=1
            )
            hidden = out.hidden_states[-1][:, -args.new_tokens - 1 : -1]
            lp, _ = token_logps(hidden, head.weight, seqs[rows, -args.new_tokens :], with_entropy=True)
            lp.sum().backward()

    forward_backward()  # warm up the shapes
    with Meter() as m:
        forward_backward()
    return dict(
        plain_generate_s=min(plain_s),
        gated_generate_s=min(gated_s),
        plain_tok_s=tokens / min(plain_s),
        gated_tok_s=tokens / min(gated_s),
        forward_backward_s=m.result["seconds"],
        forward_backward_peak_rss=m.result["peak_rss"],
        sequence_length=seqs.shape[1],
    )


def worker_step(args) -> dict:
    """GateGRPOTrainer steps (the last one measured): generation of all completions in one batch,
    the loss in micro-batches of `micro_batch` (gradient accumulation)."""
    from datasets import Dataset
    from transformers import TrainerCallback

    from rlkv.trainers import GateGRPOConfig, GateGRPOTrainer

    model, tok = load(args.model, dtype=args.dtype)
    model.train()
    per_prompt = min(args.completions, 8)
    texts = prompts(tok, 64)
    dataset = Dataset.from_dict({"prompt": texts})
    meters: list[dict] = []
    phases: dict[str, float] = {}

    class StepMeter(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.meter = Meter().__enter__()

        def on_step_end(self, *a, **k):
            self.meter.__exit__(None, None, None)
            meters.append(self.meter.result)

    class TimedTrainer(GateGRPOTrainer):
        def _generate_single_turn(self, *a, **k):
            t = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                phases["generate_s"] = time.perf_counter() - t

    config = GateGRPOConfig(
        output_dir=os.path.join(args.tmp, "step"),
        report_to="none",
        use_cpu=True,
        bf16=False,
        disable_tqdm=True,
        save_strategy="no",
        num_generations=per_prompt,
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=args.completions // args.micro_batch,
        max_completion_length=args.new_tokens,
        generation_kwargs={"min_new_tokens": args.new_tokens, "top_k": 0},
        gate_sink=GATE_SINK,
        gate_local=GATE_LOCAL,
        gate_init=0.5,
        torch_threads=args.threads,
        activation_checkpointing=bool(args.activation_checkpointing),
        max_steps=args.steps,
        logging_steps=1,
        seed=0,
    )

    def reward(completions, **kw):
        return [float("boxed" in c) for c in completions]

    trainer = TimedTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tok
    )
    trainer.add_callback(StepMeter())
    trainer.train()
    last = meters[-1]
    return dict(
        step_s=last["seconds"],
        step_cpu_util=last["cpu_util"],
        step_peak_rss=last["peak_rss"],
        all_steps_s=[m["seconds"] for m in meters],
        generate_in_step_s=phases.get("generate_s"),
        threads=torch.get_num_threads(),
    )


class _TokenClock(BaseStreamer):
    """A `generate` streamer that only stamps the time (perf_counter seconds) of each token batch it gets."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def worker_inference(args) -> dict:
    """Batch-1 greedy decode rate (tokens/s after the first) of `decode_tokens` after a `prompt_tokens`
    prompt: plain transformers (DynamicCache, sdpa) against rlkv's head-mixed cache at `sparsity` (the
    mask's compressed heads sink 16 + local 64), dynamic and static (eager); alternating, best of
    `repeats` each."""
    from transformers import DynamicCache

    from rlkv.compat import cache_kwargs
    from rlkv.inference import CompressionConfig, make_cache

    model, tok = load(args.model, dtype=args.dtype)
    text = "\n".join(prompts(tok, 64))
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    ids = ids.repeat(1, -(-args.inference_prompt_tokens // ids.shape[1]))[:, : args.inference_prompt_tokens]
    mask = torch.ones_like(ids)
    total = args.inference_prompt_tokens + args.inference_decode_tokens
    config = CompressionConfig(
        head_mask=args.inference_head_mask, sparsity=args.inference_sparsity, sink=16, window=64
    )

    def prefill_and_decode_seconds(kind: str, new_tokens: int) -> tuple[float, float]:
        """(seconds to the first new token, seconds of the other new_tokens - 1), from one generate call."""
        if kind == "plain":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            cache = make_cache(model, config, static=kind == "static", max_cache_len=total)
        clock = _TokenClock()
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
                streamer=clock,
                **cache_kwargs(cache),
            )
        # the last new_tokens stamps are the new tokens' (generate may stamp the prompt first)
        if len(clock.stamps) < new_tokens:
            raise RuntimeError(
                f"generate handed {len(clock.stamps)} token batches to its streamer, not {new_tokens}"
            )
        first_new, last_new = clock.stamps[-new_tokens], clock.stamps[-1]
        return first_new - start, last_new - first_new

    kinds = ("plain", "dynamic", "static")
    for kind in kinds:
        prefill_and_decode_seconds(kind, 4)  # warm up kernels and allocations
    # decode rate = (N - 1) / (time from the first new token to the last), stamped inside one call: the
    # prefill is apart by construction, so a noisy machine cannot make the rate negative
    first: dict[str, list[float]] = {kind: [] for kind in kinds}
    rest: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(args.inference_repeats):
        for kind in kinds:
            prefill_s, decode_s = prefill_and_decode_seconds(kind, args.inference_decode_tokens)
            first[kind].append(prefill_s)
            rest[kind].append(decode_s)
    return dict(
        prompt_tokens=args.inference_prompt_tokens,
        decode_tokens=args.inference_decode_tokens,
        sparsity=args.inference_sparsity,
        head_mask=args.inference_head_mask,
        **{f"{kind}_prefill_s": min(first[kind]) for kind in kinds},
        **{f"{kind}_tok_s": (args.inference_decode_tokens - 1) / min(rest[kind]) for kind in kinds},
        all_s=dict(first=first, decode=rest),
    )


WORKERS = {"generate": worker_generate, "step": worker_step, "inference": worker_inference}


def run_worker(kind: str, args, **overrides) -> dict:
    """Run one measurement in a fresh process; its JSON result."""
    opts = dict(
        model=args.model,
        dtype=args.dtype,
        completions=args.completions,
        new_tokens=args.new_tokens,
        micro_batch=args.micro_batch,
        steps=args.steps,
        threads=args.threads,
        activation_checkpointing=args.activation_checkpointing,
        inference_prompt_tokens=args.inference_prompt_tokens,
        inference_decode_tokens=args.inference_decode_tokens,
        inference_sparsity=args.inference_sparsity,
        inference_head_mask=args.inference_head_mask,
        inference_repeats=args.inference_repeats,
    )
    opts.update(overrides)
    cmd = [*module_command("benchmarks.real.runner"), "--worker", kind]
    for key, value in opts.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    print(f"  [{kind}] {' '.join(f'{k}={v}' for k, v in opts.items() if k != 'model')}", flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=child_env())
    if proc.returncode != 0:
        raise RuntimeError(f"worker {kind} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(
        f"    {json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()})}",
        flush=True,
    )
    return result


def suite_real(args) -> dict:
    """The real-model suite: every measurement side by side in one run, with ratios and verdicts."""
    if not args.model:
        raise SystemExit(
            "--suite real needs --model PATH (make model writes models/qwen2.5-coder-0.5b-instruct)"
        )
    gen = run_worker("generate", args)
    inference = run_worker("inference", args)
    step = run_worker("step", args)
    small = dict(completions=4, new_tokens=64, micro_batch=2, steps=2)
    small_bf16 = run_worker("step", args, dtype="bfloat16", **small)
    small_fp32 = run_worker("step", args, dtype="float32", **small)
    generate_ratio = gen["gated_tok_s"] / gen["plain_tok_s"]
    inference_ratios = {k: inference[f"{k}_tok_s"] / inference["plain_tok_s"] for k in ("dynamic", "static")}
    step_ratio = step["step_s"] / (gen["plain_generate_s"] + gen["forward_backward_s"])
    return dict(
        model=args.model,
        dtype=args.dtype,
        completions=args.completions,
        new_tokens=args.new_tokens,
        micro_batch=args.micro_batch,
        generate=gen,
        inference=inference,
        inference_ratios=inference_ratios,
        step=step,
        small_setting=small,
        small_bf16=small_bf16,
        small_fp32=small_fp32,
        generate_ratio=generate_ratio,
        step_ratio=step_ratio,
        bf16_over_fp32=small_bf16["step_s"] / small_fp32["step_s"],
        verdicts=(
            verdicts := dict(
                generate=generate_ratio >= 0.8,
                step=step_ratio <= 1.5,
                rss=step["step_peak_rss"] <= 4 * 2**30,
                cpu=step["step_cpu_util"] >= 0.75,
                inference=min(inference_ratios.values()) >= 1.0,
            )
        ),
        passed=all(verdicts.values()),
    )


def report_real(r: dict) -> list[str]:
    """Markdown lines for the real-model suite."""
    g, s = r["generate"], r["step"]
    n, t = r["completions"], r["new_tokens"]
    lines = [
        f"### Real model on CPU: {os.path.basename(r['model'].rstrip('/'))}, {r['dtype']}, "
        f"{n} completions x {t} tokens, loss micro-batch {r['micro_batch']}",
        "",
        "| measurement | value |",
        "| --- | --- |",
        f"| plain generate | {g['plain_tok_s']:.1f} tok/s ({g['plain_generate_s']:.1f} s) |",
        f"| gated generate (sink {GATE_SINK}, local {GATE_LOCAL}, random gates) | {g['gated_tok_s']:.1f} tok/s "
        f"({g['gated_generate_s']:.1f} s) |",
        f"| plain forward+backward over the {n} sequences ({g['sequence_length']} tokens) | "
        f"{g['forward_backward_s']:.1f} s |",
        f"| GRPO step (GateGRPOTrainer) | {s['step_s']:.1f} s, of which generation {s['generate_in_step_s']:.1f} s |",
        f"| peak RSS of the step | {s['step_peak_rss'] / 2**30:.2f} GiB |",
        f"| cores busy during the step | {s['step_cpu_util']:.2f} of {cores()} cores ({s['threads']} threads) |",
        f"| step, {r['small_setting']['completions']} x {r['small_setting']['new_tokens']}: bf16 / fp32 | "
        f"{r['small_bf16']['step_s']:.1f} s / {r['small_fp32']['step_s']:.1f} s = {r['bf16_over_fp32']:.2f} |",
        "",
        "| target | measured | verdict |",
        "| --- | --- | --- |",
        f"| {TARGETS['generate']} | {r['generate_ratio']:.2f} | {verdict(r['verdicts']['generate'])} |",
        f"| {TARGETS['step']} | {r['step_ratio']:.2f} | {verdict(r['verdicts']['step'])} |",
        f"| {TARGETS['rss']} | {s['step_peak_rss'] / 2**30:.2f} GiB | {verdict(r['verdicts']['rss'])} |",
        f"| {TARGETS['cpu']} | {s['step_cpu_util']:.2f} | {verdict(r['verdicts']['cpu'])} |",
    ]
    if "inference" in r:
        i, ratios = r["inference"], r["inference_ratios"]
        lines[6:6] = [
            f"| greedy decode, batch 1, prompt {i['prompt_tokens']}, {i['decode_tokens']} new: plain / rlkv "
            f"s={i['sparsity']:g} dynamic / static (eager) | {i['plain_tok_s']:.1f} / {i['dynamic_tok_s']:.1f} / "
            f"{i['static_tok_s']:.1f} tok/s |"
        ]
        lines.append(
            f"| {TARGETS['inference']} | {ratios['dynamic']:.2f} / {ratios['static']:.2f} | "
            f"{verdict(r['verdicts']['inference'])} |"
        )
    return lines


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _at_least_two(text: str) -> int:
    value = positive_int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"{value} must be >= 2")
    return value


def add_options(parser: argparse.ArgumentParser) -> None:
    """The real-model options (shared by `python -m benchmarks --suite real and the worker command line)."""
    parser.add_argument("--model", help="model folder for --suite real (make model)")
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on AVX512/AMX-BF16 CPUs), bfloat16, float32"
    )
    parser.add_argument("--completions", type=int, default=8, help="completions per GRPO step")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens per completion")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per loss forward/backward")
    parser.add_argument(
        "--steps", type=int, default=2, help="GRPO steps per step measurement (last measured)"
    )
    parser.add_argument(
        "--threads", type=int, default=0, help="torch threads per measurement (0 = every core)"
    )
    parser.add_argument("--inference-prompt-tokens", type=int, default=512, help="inference: prompt length")
    parser.add_argument(
        "--inference-decode-tokens",
        type=_at_least_two,
        default=128,
        help="inference: new tokens (>= 2: the rate is over the tokens after the first)",
    )
    parser.add_argument(
        "--inference-sparsity", type=float, default=0.5, help="inference: fraction of KV heads compressed"
    )
    parser.add_argument(
        "--inference-head-mask",
        default=str(ROOT / "results" / "masks" / "qwen2.5-coder-0.5b-instruct"),
        help="inference: the head mask (default: the shipped Qwen2.5-Coder-0.5B-Instruct mask)",
    )
    parser.add_argument(
        "--inference-repeats", type=int, default=3, help="inference: timed runs per cache (best kept)"
    )
    parser.add_argument(
        "--activation-checkpointing",
        type=int,
        default=0,
        help="1: recompute activations in the loss backward",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), required=True)
    add_options(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads or cores())  # make bench exports OMP_NUM_THREADS=1 for the others
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        args.tmp = tmp
        result = WORKERS[args.worker](args)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
