"""What the suites of `python -m benchmarks` share: the random Llama they measure, its compression modes,
timing, the targets of the performance issue, and how a suite starts a worker in its own process."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from rlkv import HeadMask
from rlkv.compat import cache_kwargs
from rlkv.inference import CompressionConfig

ROOT = Path(__file__).resolve().parents[1]  # the checkout: benchmarks/ is not part of the installed package


def module_command(module: str) -> list[str]:
    """`python -m <module>` in this interpreter: a worker in its own process (run it with `child_env()`)."""
    return [sys.executable, "-m", module]


def child_env() -> dict[str, str]:
    """This environment with the checkout first on PYTHONPATH, so `-m benchmarks...` imports from any cwd."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


ATTN_SHAPE = dict(
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=1024, intermediate_size=1024
)
SMALL_SHAPE = dict(
    num_attention_heads=8, num_key_value_heads=4, head_dim=64, hidden_size=256, intermediate_size=512
)

TARGETS = {
    "memory": "resident bytes / analytic <= 1.01 in every mode",
    "decode": "head-mixed s=0.5 / full <= 0.6 at 16K; head-mixed s=0 within 5% of stock sdpa",
    "attention": "decode attention time, head-mixed s=0.5 / full <= 0.55 at 16K",
    "overhead": "rkv scoring amortised <= 10% of a decode step (budget 1024, buffer 128)",
    "train": "gated train step / plain <= 1.5 at 4K",
}


# ---------------------------------------------------------------------------------------- setup
def build_model(shape: dict, layers: int, device: str, dtype: torch.dtype, seed: int = 0):
    """A random Llama of the given attention shape (eval mode, frozen)."""
    config = LlamaConfig(
        num_hidden_layers=layers, vocab_size=512, max_position_embeddings=65536, rope_theta=500000.0, **shape
    )
    config.name_or_path = (
        f"bench-llama-{layers}L-{shape['num_attention_heads']}h-{shape['num_key_value_heads']}kv"
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).to(device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def random_mask(model, seed: int = 0) -> HeadMask:
    return HeadMask.random(model, seed=seed)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Seconds taken by fn() (CUDA events on GPU, perf_counter on CPU)."""
    if device.startswith("cuda"):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


MODES = {
    # name: (sparsity or None for no mask, policy, budget, policy_kwargs)
    "full": (0.0, "streaming", None, {}),
    "head-mixed s=0.2": (0.2, "streaming", None, {}),
    "head-mixed s=0.4": (0.4, "streaming", None, {}),
    "head-mixed s=0.5": (0.5, "streaming", None, {}),
    "head-mixed s=0.6": (0.6, "streaming", None, {}),
    "head-mixed s=0.8": (0.8, "streaming", None, {}),
    "streaming": (None, "streaming", None, {}),
    "rkv b=1024": (None, "rkv", 1024, {}),
    "rpc P=4096": (None, "rpc", None, {}),
    "rlkv+rkv s=0.5": (0.5, "rkv", 1024, {}),
    "rlkv+rpc s=0.5": (0.5, "rpc", None, {}),
}


def compression_for(model, mode: str) -> CompressionConfig:
    sparsity, policy, budget, kwargs = MODES[mode]
    mask = random_mask(model) if sparsity is not None else None
    return CompressionConfig(
        head_mask=mask,
        sparsity=sparsity if sparsity is not None else 1.0,
        policy=policy,
        budget=budget,
        policy_kwargs=dict(kwargs),
        protect_prompt=False,  # the benchmark's context is all "generated": every token is evictable
    )


def run_decode(model, cache, ids: torch.Tensor, steps: int) -> None:
    """`steps` single-token forwards of `ids` [B, 1] against `cache`."""
    with torch.no_grad():
        for _ in range(steps):
            model(input_ids=ids, **cache_kwargs(cache), use_cache=True)
