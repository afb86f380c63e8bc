"""vLLM as rlkv's generation engine, against the transformers engine, in one run (`--vllm-parts engines`).

    .venv-vllm/bin/python -m benchmarks --suite vllm --vllm-parts engines \\
        --vllm-model models/qwen2.5-coder-0.5b-instruct --out runs/bench-vllm-engines

1. An `rlkv eval` cell: --vllm-eval-problems gsm_symbolic problems (reasoning_gym, test split), greedy,
   --vllm-eval-tokens new tokens, method `rlkv` (the shipped mask, --vllm-mask) at s=0.5 in vLLM's form
   (`window_only`: compressed heads a window of 80 tokens, no sink), the transformers engine (batch 16,
   length-sorted chunks) then the vLLM engine (eager). Per problem: generation wall time (the rows'
   `seconds`), and the whole run's wall time with model load and engine start. Equal rows are counted.
2. One GRPO step (--vllm-grpo-prompts prompts x --vllm-grpo-generations completions of
   --vllm-grpo-tokens tokens, forced by a minimum length; micro-batches of 4) with compressed rollouts at
   s=0.5: TRL's transformers path with rlkv's cache, then TRL's colocated vLLM with the head-mixed engine.
   Step wall time (rollouts, weight sync, loss), the part spent generating (TRL's
   `_generate_single_turn`) and in the weight sync, and the vLLM engine's start apart.

Each measurement is saved under --out/vllm-engines as it finishes; a rerun skips finished ones (the eval
folders resume row by row). The two GRPO steps need ~13 GB each (fp32 weights, gradients, Adam, vLLM's
copy); the first is freed before the second. Targets (issue 66): eval generation per problem,
vLLM >= 2x faster; GRPO step, vLLM <= 0.7x the transformers step's time.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

EVAL_TARGET, GRPO_TARGET = 2.0, 0.7


def add_options(parser: argparse.ArgumentParser) -> None:
    """The engines part's options."""
    parser.add_argument("--vllm-mask", default="results/masks/qwen2.5-coder-0.5b-instruct", help="head mask")
    parser.add_argument("--vllm-eval-problems", type=int, default=64)
    parser.add_argument("--vllm-eval-tokens", type=int, default=512)
    parser.add_argument("--vllm-grpo-prompts", type=int, default=4)
    parser.add_argument("--vllm-grpo-generations", type=int, default=4)
    parser.add_argument("--vllm-grpo-tokens", type=int, default=256)


def _saved(folder: Path, name: str, measure) -> dict:
    path = folder / f"{name}.json"
    if path.is_file():
        print(f"  vllm engines: {name}: kept from {path}", flush=True)
        return json.loads(path.read_text())
    result = measure()
    from rlkv._io import atomic_write_text

    atomic_write_text(path, json.dumps(result, indent=1) + "\n")
    print(f"  vllm engines: {name}: {json.dumps(result)}", flush=True)
    return result


def eval_cell(args: argparse.Namespace, folder: Path, engine: str) -> dict:
    """The eval cell on `engine`; its rows stay in folder/eval-<engine> (resumable)."""
    from rlkv.eval import EvalConfig, run_eval
    from rlkv.eval.results import read_results

    cfg = EvalConfig(
        model=args.vllm_model,
        head_mask=args.vllm_mask,
        benchmarks=["reasoning_gym:gsm_symbolic"],
        methods=["rlkv"],
        sparsities=[0.5],
        num_problems=args.vllm_eval_problems,
        max_new_tokens=args.vllm_eval_tokens,
        dtype="float32",
        batch_size=16,
        engine=engine,
        window_only=True,
        vllm_kwargs={"enforce_eager": True},
        out=str(folder / f"eval-{engine}"),
        progress=False,
    )
    began = time.perf_counter()
    run_eval(cfg)
    wall = time.perf_counter() - began
    rows = read_results(Path(cfg.out) / "results.jsonl")
    generation = sum(r["seconds"] for r in rows)
    return {
        "engine": engine,
        "problems": len(rows),
        "generation_s": generation,
        "s_per_problem": generation / len(rows),
        "run_wall_s": wall,
        "generated_tokens": sum(r["num_generated_tokens"] for r in rows),
        "solved": sum(r["correct"] for r in rows),
        "completions": {r["key"]: r["completion"] for r in rows},
    }


def grpo_step(args: argparse.Namespace, folder: Path, use_vllm: bool) -> dict:
    """One GRPO step with compressed rollouts at s=0.5 (transformers path or colocated vLLM)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from rlkv import HeadMask
    from rlkv.data.loaders import load_problems
    from rlkv.inference import load
    from rlkv.rollout import CompressedRolloutConfig, with_compressed_rollouts

    model, tokenizer = load(args.vllm_model, dtype="float32")
    mask = HeadMask.from_pretrained(args.vllm_mask, model)
    n = args.vllm_grpo_prompts
    problems = load_problems("reasoning_gym:gsm_symbolic", split="train", num=n, seed=0)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in problems["problem"]])
    tokens = args.vllm_grpo_tokens
    minimum = {"min_tokens": tokens} if use_vllm else {"min_new_tokens": tokens}
    micro = 4
    config = GRPOConfig(
        output_dir=str(folder / "grpo-out"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=n * args.vllm_grpo_generations // micro,
        num_generations=args.vllm_grpo_generations,
        max_completion_length=tokens,
        generation_kwargs=minimum,
        max_steps=1,
        logging_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        seed=0,
        learning_rate=1e-6,
        save_strategy="no",
        use_vllm=use_vllm,
        vllm_mode="colocate",
    )
    engine = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024}
    compression = CompressedRolloutConfig.for_vllm(mask, 0.5, window=80, vllm_kwargs=engine)
    began = time.perf_counter()
    trainer = with_compressed_rollouts(GRPOTrainer)(
        model=model,
        args=config,
        reward_funcs=lambda completions, **kw: [float(len(c[0]["content"]) % 7) for c in completions],
        train_dataset=dataset,
        processing_class=tokenizer,
        rollout_compression=compression,
    )
    start = time.perf_counter() - began
    spent = {"rollout_s": 0.0, "sync_s": 0.0}
    _time_calls(trainer, "_generate_single_turn", spent, "rollout_s")
    if use_vllm:
        _time_calls(trainer.vllm_generation, "sync_weights", spent, "sync_s")
    began = time.perf_counter()
    trainer.train()
    step = time.perf_counter() - began
    log = next(r for r in trainer.state.log_history if "loss" in r)
    kv = trainer.last_rollout_kv
    if use_vllm:
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
    del trainer, model  # the model, its optimizer state and vLLM's copy: ~13 GB fp32 for the 0.5B model
    gc.collect()
    return {
        "rollouts": "vllm" if use_vllm else "transformers",
        "step_s": step,
        "trainer_start_s": start,
        "completions": n * args.vllm_grpo_generations,
        **spent,
        "mean_completion_tokens": log.get("completions/mean_length"),
        "rollout_kv_ratio": log.get("rollout_kv/resident_ratio"),
        "rollout_peak_bytes": getattr(kv, "peak_bytes", None),
    }


def _time_calls(owner: Any, method: str, spent: dict[str, float], key: str) -> None:
    """Add the wall time of every call of `owner.method` (this object only) to `spent[key]`."""
    inner = getattr(owner, method)

    def timed(*args: Any, **kwargs: Any) -> Any:
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - began

    setattr(owner, method, timed)


def suite_engines(args: argparse.Namespace, out: Path) -> dict:
    """Both measurements (each kept once finished) and their checks."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if args.quick:
        args.vllm_eval_problems, args.vllm_eval_tokens, args.vllm_grpo_tokens = 4, 32, 16
        args.vllm_grpo_prompts = 1
    folder = out / "vllm-engines"
    folder.mkdir(parents=True, exist_ok=True)
    evals = {
        e: _saved(folder, f"eval-{e}", lambda e=e: eval_cell(args, folder, e))
        for e in ("transformers", "vllm")
    }
    steps = {
        name: _saved(folder, f"grpo-{name}", lambda v=(name == "vllm"): grpo_step(args, folder, v))
        for name in ("transformers", "vllm")
    }
    a, b = evals["transformers"], evals["vllm"]
    equal = sum(b["completions"].get(k) == text for k, text in a["completions"].items())
    speedup = a["s_per_problem"] / b["s_per_problem"]
    step_ratio = steps["vllm"]["step_s"] / steps["transformers"]["step_s"]
    checks = [
        {
            "what": "eval generation per problem, transformers / vLLM",
            "value": speedup,
            "target": f">= {EVAL_TARGET}x",
            "pass": speedup >= EVAL_TARGET,
        },
        {
            "what": "GRPO step, vLLM / transformers rollouts",
            "value": step_ratio,
            "target": f"<= {GRPO_TARGET}x",
            "pass": step_ratio <= GRPO_TARGET,
        },
    ]
    for e in evals.values():
        e.pop("completions")
    return {"eval": evals, "eval_equal_rows": equal, "grpo": steps, "checks": checks}


def report_engines(result: dict[str, Any], model: str) -> list[str]:
    """Markdown lines of the engines part."""
    ev, steps = result["eval"], result["grpo"]
    n = ev["transformers"]["problems"]
    lines = [
        "### vLLM as rlkv's generation engine (one run)",
        "",
        f"model {model}; `rlkv eval` cell: {n} gsm_symbolic problems, greedy, method rlkv at s=0.5 in vLLM's form "
        f"(window 80, no sink); rows equal across engines: {result['eval_equal_rows']} of {n}",
        "",
        "| engine | generation s / problem | run wall s (load + start + generation) | tokens generated | solved |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for e in ev.values():
        lines.append(
            f"| {e['engine']} | {e['s_per_problem']:.2f} | {e['run_wall_s']:.0f} | {e['generated_tokens']} | "
            f"{e['solved']} / {e['problems']} |"
        )
    lines += [
        "",
        "| GRPO rollouts | step s | of which generation s / weight sync s | trainer start s | completions | "
        "mean tokens | rollout KV / full |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for s in steps.values():
        ratio = s["rollout_kv_ratio"]
        lines.append(
            f"| {s['rollouts']} | {s['step_s']:.0f} | {s.get('rollout_s', 0):.0f} / {s.get('sync_s', 0):.1f} | "
            f"{s['trainer_start_s']:.0f} | {s['completions']} | {s['mean_completion_tokens']} | "
            f"{'' if ratio is None else f'{ratio:.2f}'} |"
        )
    lines += ["", "| check | value | target | |", "| --- | ---: | --- | --- |"]
    for c in result["checks"]:
        lines.append(
            f"| {c['what']} | {c['value']:.2f}x | {c['target']} | {'PASS' if c['pass'] else 'FAIL'} |"
        )
    return lines + [""]
