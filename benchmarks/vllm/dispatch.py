"""Torch ops per decode step of an in-process vLLM engine: stock vLLM against rlkv's forms (issue 87).

    .venv-vllm/bin/python -m benchmarks --suite vllm --vllm-parts dispatch              # ~10 min, CPU
    .venv-vllm/bin/python -m benchmarks --suite vllm --vllm-parts dispatch --quick      # demo model only

What a GPU pays per decode step, measured on the CPU: every ATen and vLLM custom op the engine's step
dispatches (counted with torch's `TorchDispatchMode` around `LLMEngine.step()`, the model runner in this
process, eager), after every request has finished its prompt. On a GPU each op is at least one kernel
launch plus its Python dispatch, and a step CUDA-graphed by stock vLLM pays neither, so the ratio to stock
bounds how far eager per-op work can stay off the critical path. Two models: the demo model (4 layers x 2
KV heads) and a synthetic model of Llama-3.1-8B's attention geometry (32 layers, 32 query heads, 8 KV
heads, head_dim 128; hidden 256 so that it fits a CPU) with a random head mask (uneven per-layer counts:
one part per KV head). Batches of 8 and 64 requests on one engine per method.

Methods: stock vLLM; rlkv (the eval's form: sink 16 + window 64 after a full prompt) at s=0.25, 0.5, 0.75;
token eviction in the eval's configs (`rlkv.eval.methods.method_config`) at R-KV's serving buffer (128: a
compaction every 128 generated tokens, none in the counted steps) and at buffer 0 (the eval's matched
config, a compaction every step: the ops of those steps are the compaction's). Ops that only make a view
(`VIEW_OPS`: no kernel on a GPU) are counted in the ops and also reported apart. Targets: rlkv s=0.5, 0.75,
rlkv+rkv s=0.75 and rkv s=0.5 at buffer 128 <= 1.3x stock's ops per step; rlkv at s=0.25 / 0.5 / 0.75
within 10% of each other.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.vllm.llm import bench_llm

TARGET_RATIO = 1.3
SPREAD = 0.10
BUFFERED = {"buffer": 128}  # R-KV's serving setting
EVERY_STEP = {"buffer": 0}  # the eval's matched config
CELLS = [
    ("rlkv", 0.25, None),
    ("rlkv", 0.5, None),
    ("rlkv", 0.75, None),
    ("rlkv+rkv", 0.75, BUFFERED),
    ("rkv", 0.5, BUFFERED),
    ("rlkv+rkv", 0.75, EVERY_STEP),
    ("rkv", 0.5, EVERY_STEP),
]
CAPPED = {("rlkv", 0.5), ("rlkv", 0.75), ("rlkv+rkv", 0.75), ("rkv", 0.5)}  # at buffer 128 for eviction
# ops that only make a view (no kernel on a GPU, no data touched): counted in the ops, reported apart
VIEW_OPS = frozenset(
    f"aten.{name}"
    for name in (
        "view", "slice", "select", "chunk", "split", "unbind", "narrow", "unsqueeze", "squeeze", "expand",
        "t", "transpose", "permute", "as_strided", "_unsafe_view", "alias", "detach",
    )
)  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Counts every op dispatched while active (ATen and custom ops), by name.

    vLLM's attention layers run as one custom op each (`vllm.unified_attention_with_output`, with a Python
    body); a dispatch mode sees that op but not the ops its body dispatches (the mode is off inside its own
    handler). So those ops are counted once and their Python body is run with the mode on: the backend's
    own ops (the stock CPU kernel, or rlkv's torch code) are counted too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        from vllm.model_executor.layers.attention import attention  # private: the custom ops' bodies

        self.bodies = {
            "vllm.unified_attention_with_output": attention.unified_attention_with_output,
            "vllm.unified_kv_cache_update": attention.unified_kv_cache_update,
        }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.ops[name] += 1
        body = self.bodies.get(name)
        if body is not None:
            with self:
                return body(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def llama_8b_geometry(folder: Path) -> Path:
    """A random Llama with Llama-3.1-8B's attention geometry and a small hidden size, saved as a folder."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=256,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=4096,
        architectures=["LlamaForCausalLM"],
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def count_decode_ops(
    model: str, overrides: dict | None, batches: list[int], prompt: int, measured: int, kv_bytes: int
) -> dict[int, dict]:
    """Ops per steady decode step of one engine, for each batch size (requests run batch by batch)."""
    import vllm

    llm = bench_llm(model, prompt + 4 * measured + 64, kv_bytes, overrides, max_num_seqs=max(batches))
    engine = llm.llm_engine
    generator = torch.Generator().manual_seed(0)
    counts = {}
    for batch in batches:
        prompts = torch.randint(10, 500, (batch, prompt), generator=generator).tolist()
        params = vllm.SamplingParams(
            temperature=0, max_tokens=4 * measured + 32, ignore_eos=True, detokenize=False
        )
        for i, ids in enumerate(prompts):
            engine.add_request(f"{batch}-{i}", {"prompt_token_ids": ids}, params)
        generated = Counter()
        while min((generated[f"{batch}-{i}"] for i in range(batch)), default=0) < 2:  # every prompt done
            for out in engine.step():
                generated[out.request_id] = len(out.outputs[0].token_ids)
        steps, kernels = [], []
        for _ in range(measured):
            with OpCounter() as counter:
                engine.step()
            steps.append(sum(counter.ops.values()))
            kernels.append(sum(n for name, n in counter.ops.items() if name not in VIEW_OPS))
        for i in range(batch):
            engine.abort_request([f"{batch}-{i}"])
        while engine.has_unfinished_requests():
            engine.step()
        counts[batch] = {
            "ops_per_step": statistics.mean(steps),
            "min": min(steps),
            "max": max(steps),
            "non_view_ops_per_step": statistics.mean(kernels),
        }
    engine.engine_core.shutdown()
    del llm, engine
    gc.collect()
    return counts


def suite_dispatch(args: argparse.Namespace) -> dict:
    """Every cell on each model, stock first; rows of ops per decode step and the checks."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoModelForCausalLM

    from rlkv import HeadMask

    tmp = tempfile.TemporaryDirectory()
    models = {"demo": "assets/demo-model"}
    if not args.quick:
        models["llama-3.1-8b geometry"] = str(llama_8b_geometry(Path(tmp.name) / "llama8b"))
    batches = [8] if args.quick else [8, 64]
    measured = 3 if args.quick else 8
    rows = []
    for name, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32
        )  # the synthetic model has no tokenizer
        mask = HeadMask.random(hf, seed=0)
        runs = [("stock", 0.0, None, None)]
        runs += [(m, s, kw, _overrides(path, hf, mask, m, s, kw)) for m, s, kw in CELLS]
        kv_heads = hf.config.num_key_value_heads
        hf = None  # the engines load their own copy
        gc.collect()
        for method, sparsity, kwargs, over in runs:
            print(f"  vllm dispatch: {name} {method} s={sparsity} {kwargs or ''} ...", flush=True)
            counts = count_decode_ops(path, over, batches, prompt=96, measured=measured, kv_bytes=2 << 30)
            for batch, c in counts.items():
                rows.append(
                    {
                        "model": name,
                        "method": method,
                        "sparsity": sparsity,
                        "buffer": (kwargs or {}).get("buffer"),
                        "batch": batch,
                        "compressed_parts_per_layer": _compressed_parts(over, kv_heads),
                        **c,
                    }
                )
                print(f"  vllm dispatch: {rows[-1]}", flush=True)
    tmp.cleanup()
    return {"dispatch": {"rows": rows, "checks": dispatch_checks(rows)}}


def _overrides(path: str, hf, mask, method: str, sparsity: float, policy_kwargs: dict | None) -> dict:
    """The engine's `hf_overrides` of a cell: rlkv's eval form, or the eval's config of an eviction method."""
    from rlkv.eval.methods import method_config
    from rlkv.inference.vllm import compression_overrides, vllm_compression

    if method == "rlkv":
        config = vllm_compression(mask, sparsity)
    else:
        kwargs = {"rkv": policy_kwargs}
        config = method_config(method, sparsity, model=hf, masks={"rlkv": mask}, policy_kwargs=kwargs)
    return compression_overrides(path, config)


def _compressed_parts(overrides: dict | None, kv_heads: int) -> int | None:
    """The most compressed attention modules a layer has: its compressed heads over the split's unit (the gcd
    of every layer's full and compressed counts, `HeadSplit.unit`)."""
    if overrides is None:
        return None
    full = [len(layer) for layer in overrides["rlkv_head_split"]["full_kv_heads"]]
    unit = math.gcd(*full, *(kv_heads - f for f in full))
    return max(kv_heads - f for f in full) // unit


def dispatch_checks(rows: list[dict]) -> list[dict]:
    """Per model and batch: the capped cells' ratio to stock (<= 1.3x) and rlkv's spread across sparsities."""
    checks = []
    for model, batch in dict.fromkeys((r["model"], r["batch"]) for r in rows):
        mine = [r for r in rows if r["model"] == model and r["batch"] == batch]
        stock = next(r["ops_per_step"] for r in mine if r["method"] == "stock")
        for r in mine:
            if (r["method"], r["sparsity"]) in CAPPED and r["buffer"] in (None, BUFFERED["buffer"]):
                ratio = r["ops_per_step"] / stock
                what = f"{r['method']} s={r['sparsity']}" + (f" buffer {r['buffer']}" if r["buffer"] else "")
                checks.append(
                    {
                        "model": model,
                        "batch": batch,
                        "what": what,
                        "value": ratio,
                        "target": f"<= {TARGET_RATIO}x",
                    }
                    | {"pass": ratio <= TARGET_RATIO}
                )
        rlkv = [r["ops_per_step"] for r in mine if r["method"] == "rlkv"]
        spread = max(rlkv) / min(rlkv) - 1
        checks.append(
            {"model": model, "batch": batch, "what": "rlkv s=0.25 / 0.5 / 0.75 spread", "value": spread}
            | {"target": f"<= {SPREAD:.0%}", "pass": spread <= SPREAD}
        )
    return checks


def report_dispatch(part: dict) -> list[str]:
    """Markdown lines of the dispatch part: ops per decode step, then the checks with PASS/FAIL."""
    lines = [
        "## vLLM: torch ops per decode step (one run, in-process engine, eager)",
        "",
        "| model | batch | method | sparsity | buffer | compressed parts / layer | ops / step (mean) | min | max "
        "| vs stock | non-view ops / step | vs stock |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    rows = part["rows"]
    stock = {(r["model"], r["batch"]): r for r in rows if r["method"] == "stock"}
    for r in rows:
        base = stock[(r["model"], r["batch"])]
        ratio = r["ops_per_step"] / base["ops_per_step"]
        buffer = "" if r["buffer"] is None else r["buffer"]
        kernels = r.get("non_view_ops_per_step")
        kernel_cells = (
            f"{kernels:.0f} | {kernels / base['non_view_ops_per_step']:.2f}x"
            if kernels is not None
            else " | "
        )
        lines.append(
            f"| {r['model']} | {r['batch']} | {r['method']} | {r['sparsity']} | {buffer} "
            f"| {r['compressed_parts_per_layer'] or ''} | {r['ops_per_step']:.0f} | {r['min']} | {r['max']} "
            f"| {ratio:.2f}x | {kernel_cells} |"
        )
    lines += ["", "| model | batch | check | value | target | |", "| --- | ---: | --- | ---: | --- | --- |"]
    for c in part["checks"]:
        value = f"{c['value']:.0%}" if "spread" in c["what"] else f"{c['value']:.2f}x"
        verdict = "PASS" if c["pass"] else "FAIL"
        lines.append(f"| {c['model']} | {c['batch']} | {c['what']} | {value} | {c['target']} | {verdict} |")
    return lines + [""]
