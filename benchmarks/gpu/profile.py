"""What the GPU suite (benchmarks/gpu/runner.py) measures besides time: the model geometries it builds on the
device, the SDPA backend pins, the card's copy bandwidth, and per-step counts read from a torch.profiler
trace (kernel launches, CUDA graph launches, host syncs, GPU-busy fraction)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import torch

# random-weight geometries of real models (../shared/gpu/README.md); "tiny" is the CPU smoke geometry
GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(
        model_type="qwen2",
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        hidden_size=3584,
        intermediate_size=18944,
        vocab_size=152064,
    ),
    "llama-3.1-8b": dict(
        model_type="llama",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_size=4096,
        intermediate_size=14336,
        vocab_size=128256,
    ),
    "tiny": dict(
        model_type="qwen2",
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=512,
    ),
}

STEP_MARK = "bench:step"  # a profiler range opened at the end of every decode step (stopping criterion)
FORWARD_MARK = "bench:forward"  # a profiler range opened when the model's forward starts
LAUNCH_NAMES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
GRAPH_LAUNCH_NAMES = ("cudaGraphLaunch", "cuGraphLaunch")
# host calls that block until the device catches up; a blocking `cudaMemcpy` (not Async) too
SYNC_NAMES = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaEventSynchronize",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
    "cudaMemcpy",
)
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def geometry_config(name: str):
    """A transformers config of geometry `name` (GEOMETRIES) with no EOS: every row decodes to the end."""
    from transformers import AutoConfig

    if name not in GEOMETRIES:
        raise ValueError(f"--gpu-geometry {name!r}: choose one of {', '.join(GEOMETRIES)}")
    spec = dict(GEOMETRIES[name])
    config = AutoConfig.for_model(
        spec.pop("model_type"),
        **spec,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    config.name_or_path = f"random-{name}"
    return config


def build_random_model(name: str, device: str, dtype: torch.dtype):
    """A random-weight causal LM of geometry `name`, built directly on `device` (eval mode, frozen).

    ~10 s for the 7B geometry on an H100 (no host copy of the weights)."""
    from transformers import AutoModelForCausalLM

    config = geometry_config(name)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    for p in model.parameters():
        p.requires_grad_(False)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter but the input embedding (a step gathers
    batch rows of it), unless it is tied to the output head."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight
    tied = embed is model.get_output_embeddings().weight
    return total if tied else total - embed.numel() * embed.element_size()


@contextlib.contextmanager
def sdpa_backends(choice: str, device: str) -> Iterator[None]:
    """Pin torch's SDPA backend: "default" leaves torch's choice (cuDNN first on Hopper), "flash" allows
    only the flash kernel, "no-cudnn" allows flash, efficient and math (never cuDNN, which builds a graph
    per key length: 2-4.5 ms of host time per call when the length changes every step)."""
    if choice == "default":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if choice == "flash":
        backends = [SDPBackend.FLASH_ATTENTION]
    elif choice == "no-cudnn":
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    else:
        raise ValueError(f"SDPA backend choice {choice!r}: use default, flash or no-cudnn")
    if not device.startswith("cuda"):
        backends.append(SDPBackend.MATH)  # CPU: torch's flash kernel, math where it has none
    with sdpa_kernel(backends):
        yield


def copy_bandwidth(device: str, megabytes: int = 1024, repeats: int = 5) -> float:
    """Bytes per second one device-to-device copy moves (read + write counted), best of `repeats`."""
    n = megabytes * 2**20 // 2
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t)
    return 2 * n * 2 / best


def profiler(device: str) -> torch.profiler.profile:
    """A torch.profiler (CPU, and CUDA activity on a GPU) to `start()` and `stop()` around a few steps."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.startswith("cuda"):
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities)


def trace_events(prof: torch.profiler.profile) -> list[dict]:
    """The stopped profiler's events, read from its Chrome trace (stable across torch versions)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            doc = json.load(f)
    finally:
        os.unlink(path)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "ts" in e]


def api_name(name: str) -> str:
    """A CUDA API name without the version / per-thread-stream suffix CUPTI may add
    (cudaLaunchKernelExC_v11060, cudaLaunchKernel_ptsz -> cudaLaunchKernelExC, cudaLaunchKernel)."""
    return re.sub(r"(_v\d+|_ptsz|_ptds)+$", "", name)


def _between(times: list[float], lo: float, hi: float) -> int:
    return sum(1 for t in times if lo < t < hi)


def step_counts(events: list[dict], device: str) -> dict[str, float | None]:
    """Per-step counts over the profiled steps: the window runs from the first to the last STEP_MARK.

    kernel_launches / graph_launches: runtime launch calls per step; host_syncs: blocking host calls
    (SYNC_NAMES) per step; forward_syncs / loop_syncs: of those, the ones after / before the step's
    FORWARD_MARK (None without forward marks: a compiled forward); gpu_busy: the union of device
    kernel/copy/memset time over the window length. All None on CPU except the step count.
    """
    marks = sorted(e["ts"] for e in events if e.get("cat") == "user_annotation" and e["name"] == STEP_MARK)
    forwards = sorted(
        e["ts"] for e in events if e.get("cat") == "user_annotation" and e["name"] == FORWARD_MARK
    )
    steps = len(marks) - 1
    out: dict[str, float | None] = dict(
        profiled_steps=steps,
        kernel_launches=None,
        graph_launches=None,
        host_syncs=None,
        forward_syncs=None,
        loop_syncs=None,
        gpu_busy=None,
    )
    if steps < 1 or not device.startswith("cuda"):
        return out
    lo, hi = marks[0], marks[-1]
    runtime = [
        (e["ts"], api_name(e["name"])) for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")
    ]
    launches = [t for t, name in runtime if name in LAUNCH_NAMES]
    graphs = [t for t, name in runtime if name in GRAPH_LAUNCH_NAMES]
    syncs = [t for t, name in runtime if name in SYNC_NAMES]
    out["kernel_launches"] = _between(launches, lo, hi) / steps
    out["graph_launches"] = _between(graphs, lo, hi) / steps
    out["host_syncs"] = _between(syncs, lo, hi) / steps
    starts = [next((f for f in forwards if a < f < b), None) for a, b in zip(marks, marks[1:])]
    if all(s is not None for s in starts):
        out["loop_syncs"] = sum(_between(syncs, a, f) for a, f in zip(marks, starts)) / steps
        out["forward_syncs"] = sum(_between(syncs, f, b) for f, b in zip(starts, marks[1:])) / steps
    intervals = sorted(
        (max(e["ts"], lo), min(e["ts"] + e.get("dur", 0), hi))
        for e in events
        if e.get("cat") in DEVICE_CATEGORIES
    )
    busy, end = 0.0, lo
    for a, b in intervals:  # the union of overlapping intervals (kernels on several streams)
        if b > max(a, end):
            busy += b - max(a, end)
            end = b
    out["gpu_busy"] = busy / (hi - lo) if hi > lo else None
    return out


class HostReads:
    """Counts host-reading tensor operations on CPU with `rlkv.testing.HostSyncCounter`, when that exists
    (it does what `torch.cuda.set_sync_debug_mode` does on a GPU); `available` is False otherwise."""

    def __init__(self) -> None:
        try:
            from rlkv.testing import HostSyncCounter  # type: ignore[attr-defined]
        except ImportError:
            HostSyncCounter = None  # noqa: N806
        self.cls = HostSyncCounter
        self.available = HostSyncCounter is not None

    @contextlib.contextmanager
    def count(self) -> Iterator[list[int]]:
        """Yields a one-element list that holds the count once the block ends."""
        box = [0]
        if self.cls is None:
            yield box
            return
        with self.cls() as counter:
            yield box
        box[0] = int(next(getattr(counter, a) for a in ("count", "total", "syncs") if hasattr(counter, a)))
