"""The gpu-train suite of `python -m benchmarks`: one GRPO gate-training step on Qwen2.5-7B's geometry, parts timed.

    python -m benchmarks --suite gpu-train --device cuda --out $OUT/gpu-train   # one H100/H200
    python -m benchmarks --suite gpu-train --quick --out runs/gpu-train         # tiny geometry, CPU, seconds

Random weights of Qwen2.5-7B's geometry in bf16, built on the device; `GateGRPOTrainer` with the
gates trainable and activation checkpointing runs one GRPO step of P prompts x G completions x N
tokens (default 16 x 4 x 1024, EOS suppressed by `min_new_tokens`), and a timing subclass records
its parts: the gated rollout, the log-prob passes, the loss forward and the backward (the
training step minus generation and loss forward). Then, side by side on the same model and
prompts: the plain rollout (gates detached, stock attention), one explicit no-grad log-prob pass
(the old/reference log-probs a step needs once rollouts are off-policy), and the same step with
compressed rollouts (`with_compressed_rollouts(GRPOTrainer)`, random head mask at sparsity 0.5,
streaming compressed heads; LoRA r=8 on q/v as the trainable part, since compressed rollouts
refuse a gated model). Per rollout decode step (one single-token forward with the rollout's own
cache): kernel launches (torch.profiler, CUDA) and host syncs (`torch.cuda.set_sync_debug_mode`
on CUDA, `rlkv.testing.HostSyncCounter` on CPU). Peak allocated memory is
`torch.cuda.max_memory_allocated` per part and for the step (None on CPU).

`--train-budget-s` bounds the whole suite: after the decode probe it lowers N (never raises it)
so that the three rollouts and the loss passes fit, and the report says so. `--quick` is the
CPU smoke (tiny geometry, a few tokens) that tests/test_bench_gpu_train.py runs.
`--train-micro-batch` runs the loss in gradient-accumulation micro-batches (one rollout per step).
The measurement helpers are in benchmarks/gpu_train/parts.py, the markdown in report.py.
"""

from __future__ import annotations

import argparse
import copy
import gc
import random
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache, Qwen2Config

from benchmarks.gpu.profile import GEOMETRIES
from benchmarks.gpu_train.parts import (
    PartTimer,
    count_host_syncs,
    count_kernel_launches,
    decode_probe,
    logged,
    rollout_part,
    step_callback,
    step_parts,
    timed_trainer,
)
from benchmarks.gpu_train.report import report_gpu_train  # noqa: F401 (benchmarks/__main__.py: the section)
from rlkv.compat import activation_checkpointing_kwargs


def _qwen2_geometry(name: str, **overrides: int) -> dict:
    """A geometry of benchmarks.gpu.profile.GEOMETRIES (all Qwen2) as Qwen2Config keyword arguments."""
    return {**{k: v for k, v in GEOMETRIES[name].items() if k != "model_type"}, **overrides}


QWEN25_7B = _qwen2_geometry("qwen2.5-7b")
TINY = _qwen2_geometry("tiny", vocab_size=1024)
WINDOW = (128, 256)  # sink, local: the paper's training window (gates and compressed heads)
QUICK_WINDOW = (2, 4)  # the quick run's sequences are ~24 tokens: small enough to evict


# ------------------------------------------------------------------------------------ setup
def build_model(geometry: dict, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random Qwen2 of `geometry`, built directly on `device` in `dtype`, weights frozen."""
    config = Qwen2Config(max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=False, **geometry)
    config.name_or_path = f"random Qwen2 {geometry['num_hidden_layers']}L {geometry['hidden_size']}d"
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def prompt_dataset(tokenizer, num_prompts: int, prompt_tokens: int, seed: int = 0):
    """`num_prompts` text prompts of about `prompt_tokens` tokens each (random tokenizer pieces)."""
    from datasets import Dataset

    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    pieces = [i for i in range(len(tokenizer)) if i not in special]
    texts = [tokenizer.decode([rng.choice(pieces) for _ in range(prompt_tokens)]) for _ in range(num_prompts)]
    return Dataset.from_dict({"prompt": texts})


def random_reward(completions, **kwargs) -> list[float]:
    """Seeded random rewards: non-zero advantages, so the loss has a real gradient."""
    rng = random.Random(len(completions))
    return [rng.random() for _ in completions]


def grpo_settings(args, device: torch.device, tokens: int, output_dir: str) -> dict:
    """GRPOConfig fields shared by the gated and the compressed-rollout step."""
    rows = args.train_prompts * args.train_generations
    micro = args.train_micro_batch or rows
    if rows % micro:
        raise SystemExit(f"--train-micro-batch {micro} must divide the {rows} completions of a step")
    return dict(
        output_dir=output_dir,
        report_to="none",
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda",
        disable_tqdm=True,
        save_strategy="no",
        num_generations=args.train_generations,
        # the loss runs in micro-batches of --train-micro-batch completions (gradient accumulation); the
        # rollout still samples all of them in one generate call (TRL's steps_per_generation)
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        max_completion_length=tokens,
        generation_kwargs={"min_new_tokens": tokens, "top_k": 0},
        # TRL's field: "static" decodes on transformers' StaticCache (compiled with CUDA graphs on CUDA)
        cache_implementation=None if args.train_rollout_cache == "dynamic" else args.train_rollout_cache,
        **activation_checkpointing_kwargs(True),
        max_steps=1,
        logging_steps=1,
        seed=0,
    )


def short_rollout(trainer, prompt_ids: list[list[int]], generations: int, tokens: int) -> None:
    """An untimed rollout of exactly `tokens` new tokens through the trainer's own generation path."""
    saved = trainer.generation_config
    trainer.generation_config = copy.deepcopy(saved)
    trainer.generation_config.max_new_tokens = trainer.generation_config.min_new_tokens = tokens
    try:
        # the class's own method, not the timing subclass's: nothing is recorded
        type(trainer).__mro__[1]._generate_single_turn(trainer, prompt_ids, None, {}, generations)
    finally:
        trainer.generation_config = saved


def warm_up_and_count(trainer, tokenizer, dataset, generations: int, device: torch.device) -> dict:
    """Warm the trainer's rollout path up (so the timed step does not pay first-call costs the plain
    rollout, run later, would not), then count host syncs and kernel launches per decode step of the
    whole rollout loop (generate's own per-step work included): the difference between rollouts of
    12 and 4 tokens, over 8 steps, so per-rollout setup and the final read-back cancel."""
    prompt_ids = [ids for ids in tokenizer(list(dataset["prompt"]))["input_ids"] for _ in range(generations)]

    def rollout(tokens: int):
        return lambda: short_rollout(trainer, prompt_ids, generations, tokens)

    rollout(4)()
    syncs = count_host_syncs(rollout(12), device) - count_host_syncs(rollout(4), device)
    launches = [count_kernel_launches(rollout(n), device) for n in (12, 4)]
    return dict(
        host_syncs_per_step=syncs / 8,
        kernel_launches_per_step=None if launches[0] is None else (launches[0] - launches[1]) / 8,
    )


def plan_tokens(requested: int, budget_left_s: float, probe: dict, prompt_tokens: int) -> int:
    """Completion tokens N <= `requested` whose suite fits `budget_left_s` (estimated from the probe).

    Three rollouts of N decode steps (gated, plain, compressed) at the probe's step time, with 50%
    for generate's own per-step work, plus ~12 forward-equivalents of the prompt + N token batch
    (two loss forwards, two backwards with recomputation, log-prob passes) scaled from the prefill.
    Rounded down to a multiple of 64 above 64.
    """
    per_token = 3 * 1.5 * probe["seconds_per_step"] + 12 * probe["prefill_seconds"] / prompt_tokens
    tokens = int((0.8 * budget_left_s - 12 * probe["prefill_seconds"]) / per_token)
    tokens = min(requested, max(1, tokens))
    return tokens - tokens % 64 if 64 < tokens < requested else tokens


# ------------------------------------------------------------------------------------ suite
def suite_gpu_train(args) -> dict:
    """Run the suite (see the module docstring); the JSON-ready results with PASS/FAIL per target."""
    from trl import GRPOConfig, GRPOTrainer

    import rlkv
    from rlkv.head_mask import HeadMask
    from rlkv.inference import make_cache
    from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts
    from rlkv.testing import tiny_tokenizer
    from rlkv.trainers import GateGRPOConfig, GateGRPOTrainer

    started = time.perf_counter()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--suite gpu-train --device cuda: torch sees no CUDA device here")
    if device.type != "cuda" and not args.quick:
        raise SystemExit("--suite gpu-train builds a 7B model: use --device cuda, or --quick (tiny, CPU)")
    if args.quick:
        geometry, prompts, generations, prompt_tokens = TINY, 2, 2, 8
        requested = min(args.train_tokens, 16)
    else:
        geometry, prompts, generations = QWEN25_7B, args.train_prompts, args.train_generations
        prompt_tokens, requested = args.train_prompt_tokens, args.train_tokens
    args.train_prompts, args.train_generations = prompts, generations
    rows = prompts * generations
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    build = PartTimer(device)
    with build.part("build"):
        model = build_model(geometry, device, dtype)
    weights_bytes = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    tokenizer = tiny_tokenizer()
    dataset = prompt_dataset(tokenizer, prompts, prompt_tokens)
    vocab = geometry["vocab_size"]

    # gated: decode probe, then one GateGRPOTrainer step of N tokens (N from the budget)
    sink, local = QUICK_WINDOW if args.quick else WINDOW
    rlkv.attach_gates(model, sink=sink, local=local, init=0.5)
    gated_probe = decode_probe(model, lambda: DynamicCache(config=model.config), rows, prompt_tokens, vocab)
    left = args.train_budget_s - (time.perf_counter() - started)
    tokens = plan_tokens(requested, left, gated_probe, prompt_tokens)
    print(
        f"  gpu-train: {rows} rollouts x {tokens} tokens (requested {requested}; {left:.0f}s left)",
        flush=True,
    )
    tmp = tempfile.TemporaryDirectory(prefix="gpu-train-")
    timer = PartTimer(device)
    config = GateGRPOConfig(
        **grpo_settings(args, device, tokens, f"{tmp.name}/gated"),
        gate_sink=sink,
        gate_local=local,
        gate_init=0.5,
    )
    trainer = timed_trainer(GateGRPOTrainer, timer)(
        model=model,
        reward_funcs=random_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_callback(timer)],
    )
    gated_loop = warm_up_and_count(trainer, tokenizer, dataset, generations, device)
    trainer.train()
    gated = step_parts(timer)
    in_step = len(timer.records.get("logps_no_grad", []))
    # the no-grad log-prob pass of an off-policy step (old / reference log-probs), on the step's sequences
    with torch.no_grad():
        for inputs in trainer.loss_inputs:  # the step's micro-batches
            trainer._get_per_token_logps_and_entropies(
                trainer.model,
                torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
                inputs["completion_ids"].size(1),
                batch_size=inputs["completion_ids"].size(0),
            )
    logps_pass_seconds = sum(r["seconds"] for r in timer.records["logps_no_grad"][in_step:])

    # plain: the same rollout call with the gates detached (stock attention), and its decode probe
    rlkv.detach_gates(model)
    call_args, call_kwargs = trainer.rollout_call
    trainer._generate_single_turn(*call_args, **call_kwargs)
    plain_probe = decode_probe(model, lambda: DynamicCache(config=model.config), rows, prompt_tokens, vocab)
    gated_rollout, plain_rollout = rollout_part(timer, 0), rollout_part(timer, 1)
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    # printed now: the log keeps them if a later part overruns a hard time limit
    print(
        f"  gpu-train: gated step {gated['step_seconds']:.1f}s (peak {gated['step_peak_bytes']}), rollout "
        f"{gated_rollout['tokens_per_second']:.0f} tok/s gated vs {plain_rollout['tokens_per_second']:.0f} "
        f"plain; decode syncs/step {gated_probe['host_syncs_per_step']}, launches/step "
        f"{gated_probe['kernel_launches_per_step']}",
        flush=True,
    )
    results = dict(
        args=args,
        device=device,
        geometry=geometry,
        dtype=dtype,
        tokens=tokens,
        requested=requested,
        build_seconds=build.seconds("build"),
        weights_bytes=weights_bytes,
        gated=dict(
            **gated,
            rollout=gated_rollout,
            probe=gated_probe,
            rollout_loop=gated_loop,
            logps_pass_seconds=logps_pass_seconds,
        ),
        plain=dict(rollout=plain_rollout, probe=plain_probe),
    )
    left = args.train_budget_s - (time.perf_counter() - started)
    if left < 1.2 * gated["step_seconds"]:  # the compressed step costs about what the gated one did
        tmp.cleanup()
        skipped = (
            f"skipped: {left:.0f}s of --train-budget-s left, the gated step took {gated['step_seconds']:.0f}s"
        )
        return summarize(
            **results, compressed={"skipped": skipped}, wall_seconds=time.perf_counter() - started
        )

    # compressed rollouts: the same step through with_compressed_rollouts(GRPOTrainer), LoRA trainable
    from peft import LoraConfig, get_peft_model

    compression = CompressedRolloutConfig(
        head_mask=HeadMask.random(model, seed=0),
        sparsity=args.train_sparsity,
        policy="streaming",
        sink=sink,
        window=local,
        # --train-rollout-cache static: rlkv's static-shape cache, compiled with CUDA graphs on CUDA
        static_cache=args.train_rollout_cache == "static",
    )
    peft_model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    ctimer = PartTimer(device)
    ctrainer = timed_trainer(with_compressed_rollouts(GRPOTrainer), ctimer)(
        model=peft_model,
        reward_funcs=random_reward,
        # its rollouts bring their own cache (rlkv's, dynamic or static as --train-rollout-cache says)
        args=GRPOConfig(
            **{**grpo_settings(args, device, tokens, f"{tmp.name}/compressed"), "cache_implementation": None}
        ),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[step_callback(ctimer)],
        rollout_compression=compression,
    )
    compressed_loop = warm_up_and_count(ctrainer, tokenizer, dataset, generations, device)
    ctrainer.train()
    compressed = step_parts(ctimer)
    kv = ctrainer.last_rollout_kv
    compressed.update(
        rollout=rollout_part(ctimer, 0),
        rollout_loop=compressed_loop,
        rollout_cache="static" if ctrainer.rollout_generator.kept_static_cache is not None else "dynamic",
        resident_kv_bytes=kv.resident_bytes,
        peak_kv_bytes=kv.peak_bytes,
        full_kv_bytes=kv.full_resident_bytes,
        importance_sampling_ratio={
            s: logged(ctrainer, f"sampling/importance_sampling_ratio/{s}") for s in ("min", "mean", "max")
        },
    )
    resolved = ctrainer._rollout_cache_config
    del ctrainer
    with torch.no_grad():
        compressed["probe"] = decode_probe(
            model, lambda: make_cache(model, resolved, batch_size=rows), rows, prompt_tokens, vocab
        )
    tmp.cleanup()
    return summarize(**results, compressed=compressed, wall_seconds=time.perf_counter() - started)


def summarize(
    args, *, device, geometry, dtype, tokens, requested, weights_bytes, gated, plain, compressed, **rest
) -> dict:
    """The suite's results: the measurements, the side-by-side ratios and a verdict per target."""
    baseline = (
        plain["rollout"]["seconds"]
        + gated["logps_pass_seconds"]
        + gated["loss_forward_seconds"]
        + gated["backward_seconds"]
    )
    rollout_ratio = gated["rollout"]["tokens_per_second"] / plain["rollout"]["tokens_per_second"]
    step_ratio = gated["step_seconds"] / baseline
    cap = args.train_memory_gb * 1e9
    peak = gated["step_peak_bytes"]
    # activations and logits grow about linearly with completion tokens; the weights do not
    estimate = None if peak is None else int(tokens * (cap - weights_bytes) / max(1, peak - weights_bytes))
    targets = {
        "rollout": rollout_ratio >= 0.8,
        "step": step_ratio <= 1.5,
        "syncs": gated["probe"]["host_syncs_per_step"] == 0,
        "memory": None if peak is None else peak <= cap,  # no allocator peak on CPU
    }
    return dict(
        device=str(device),
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        geometry=geometry,
        dtype=str(dtype),
        prompts=args.train_prompts,
        generations=args.train_generations,
        tokens=tokens,
        tokens_requested=requested,
        budget_seconds=args.train_budget_s,
        sparsity=args.train_sparsity,
        weights_bytes=weights_bytes,
        gated=gated,
        plain=plain,
        compressed=compressed,
        rollout_ratio=rollout_ratio,
        step_baseline_seconds=baseline,
        step_ratio=step_ratio,
        memory_cap_bytes=cap,
        max_tokens_per_completion_estimate=estimate,
        targets=targets,
        passed=all(ok for ok in targets.values() if ok is not None),
        **rest,
    )


def add_options(parser: argparse.ArgumentParser) -> None:
    """The gpu-train options of `python -m benchmarks`."""
    group = parser.add_argument_group("gpu-train suite")
    group.add_argument("--train-budget-s", type=float, default=400, help="seconds for the whole suite")
    group.add_argument("--train-prompts", type=int, default=16, help="prompts per GRPO step")
    group.add_argument("--train-generations", type=int, default=4, help="completions per prompt")
    group.add_argument("--train-tokens", type=int, default=1024, help="tokens per completion (a maximum)")
    group.add_argument("--train-prompt-tokens", type=int, default=256, help="tokens per prompt (about)")
    group.add_argument("--train-sparsity", type=float, default=0.5, help="compressed-rollout sparsity")
    group.add_argument(
        "--train-rollout-cache",
        choices=["dynamic", "static"],
        default="dynamic",
        help="the rollouts' cache: gated and plain through GRPOConfig.cache_implementation (static: "
        "transformers' StaticCache), compressed through CompressedRolloutConfig.static_cache (static: rlkv's "
        "StaticHeadMixedCache); transformers compiles static decode steps (reduce-overhead, CUDA graphs) on CUDA",
    )
    group.add_argument("--train-memory-gb", type=float, default=80, help="memory target, GB (1e9 bytes)")
    group.add_argument(
        "--train-micro-batch",
        type=int,
        default=0,
        help="completions per loss forward/backward (gradient accumulation); 0 = all of the step's",
    )
