"""One probe of the serve suite (benchmarks/serve/runner.py): a method's cache, one generation stopped once
its resident KV goes over the cap, the search for the largest batch that fits (and its starting
guess), and the record of finished probes that lets a killed suite resume."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlkv.compat import cache_kwargs


@dataclass(frozen=True)
class Method:
    """One serving configuration: a head mask cut at `sparsity` (None: no mask), a policy and its budget."""

    name: str
    sparsity: float | None  # None: no head mask (every head compressed), or plain full KV when policy is None
    policy: str | None  # None: plain transformers (DynamicCache, sdpa)
    budget: int | None = None
    policy_kwargs: dict[str, Any] = field(default_factory=dict)


def methods(budget: int, extra_policies: list[str]) -> list[Method]:
    """The suite's methods; `extra_policies` run on every head at `budget`."""
    out = [
        Method("full", None, None),
        Method("rlkv s=0.5", 0.5, "streaming"),
        Method("rlkv s=0.75", 0.75, "streaming"),
        Method(f"rkv b={budget}", None, "rkv", budget),
        Method("rlkv+rkv s=0.5", 0.5, "rkv", budget),
    ]
    return out + [Method(f"{p} b={budget}", None, p, budget) for p in extra_policies]


def protect_prompt(spec: str) -> bool:
    """Whether the compressed heads keep the prompt: not for a random geometry of
    benchmarks.gpu.profile.GEOMETRIES, whose long random prompt stands in for generated reasoning (every token
    evictable, as in the decode suite)."""
    from benchmarks.gpu.profile import GEOMETRIES

    return spec not in GEOMETRIES


def kv_resident_bytes(cache) -> int:
    """Bytes the cache's tensors hold: `resident_bytes()` of a HeadMixedCache, the key/value storages
    of a plain transformers cache."""
    if hasattr(cache, "resident_bytes"):
        return cache.resident_bytes()
    from rlkv.cache.store import storage_bytes

    return storage_bytes([t for layer in cache.layers for t in (layer.keys, layer.values)])


def make_method_cache(
    model, method: Method, mask_path: str | None, seed: int = 0, protect_prompt: bool = True
):
    """The cache of `method` for `model` (a DynamicCache with stock sdpa for full); `protect_prompt`:
    the compressed heads keep the whole prompt (False: it is evictable like generated tokens)."""
    from transformers import DynamicCache

    from rlkv import HeadMask
    from rlkv.inference import CompressionConfig, make_cache

    if method.policy is None:
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    mask = None
    if method.sparsity is not None:
        mask = HeadMask.from_pretrained(mask_path, model) if mask_path else HeadMask.random(model, seed=seed)
    config = CompressionConfig(
        head_mask=mask,
        sparsity=method.sparsity if method.sparsity is not None else 1.0,
        policy=method.policy,
        budget=method.budget,
        policy_kwargs=dict(method.policy_kwargs),
        protect_prompt=protect_prompt,
    )
    return make_cache(model, config)


# ------------------------------------------------------------------------------------------- probe
class _StepMeter:
    """A stopping criterion that reads the resident KV and a timestamp after every generated token,
    and stops the run once the KV goes over the cap, or once `deadline` (perf_counter) has passed."""

    def __init__(self, cache, cap_bytes: int, device: str, deadline: float = float("inf")) -> None:
        self.cache, self.cap, self.device, self.deadline = cache, cap_bytes, device, deadline
        self.times: list[float] = []
        self.peak_kv = 0
        self.over = self.timed_out = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        self.peak_kv = max(self.peak_kv, kv_resident_bytes(self.cache))
        self.over = self.over or self.peak_kv > self.cap
        self.timed_out = self.timed_out or self.times[-1] > self.deadline
        stop = self.over or self.timed_out
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def serve_probe(
    model,
    prompt_ids: torch.Tensor,
    method: Method,
    batch: int,
    new_tokens: int,
    cap_bytes: int,
    device: str = "cpu",
    mask_path: str | None = None,
    seed: int = 0,
    protect_prompt: bool = True,
    deadline: float = float("inf"),
) -> dict:
    """One real run: `batch` rows of `prompt_ids` [1, P], `new_tokens` sampled tokens each (EOS
    suppressed). Returns fits (peak resident KV <= cap for the whole run), peak_kv_bytes,
    generated (tokens per row; fewer when the run stopped over the cap), tokens/s (whole run and
    steady-state decode: the second half of the steps) and peak process memory since the call;
    timed_out: stopped at `deadline` (perf_counter seconds), which says nothing about the cap.
    On CUDA, SDPA runs without cuDNN for every method (cuDNN builds a graph per key length)."""
    from transformers import StoppingCriteriaList

    from benchmarks.gpu.profile import sdpa_backends
    from benchmarks.real.runner import peak_rss_bytes, reset_peak_rss

    cache = make_method_cache(model, method, mask_path, seed, protect_prompt)
    meter = _StepMeter(cache, cap_bytes, device, deadline)
    ids = prompt_ids.expand(batch, -1).contiguous()
    reset_peak_rss()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    torch.manual_seed(seed)
    oom = False
    start = time.perf_counter()
    try:
        with torch.no_grad(), sdpa_backends("no-cudnn" if device.startswith("cuda") else "default", device):
            model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                **cache_kwargs(cache),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,  # EOS suppressed: every row runs to the end
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                pad_token_id=0,
                stopping_criteria=StoppingCriteriaList([meter]),
            )
    except torch.OutOfMemoryError:
        oom = True
    wall = time.perf_counter() - start
    generated = len(meter.times)
    fits = not (meter.over or oom or meter.timed_out) and generated == new_tokens
    result = dict(
        method=method.name,
        batch=batch,
        fits=fits,
        out_of_memory=oom,
        timed_out=meter.timed_out and not meter.over,
        generated=generated,
        prompt_tokens=int(prompt_ids.shape[1]),
        peak_kv_bytes=meter.peak_kv,
        peak_rss_bytes=peak_rss_bytes(),
        peak_cuda_bytes=torch.cuda.max_memory_allocated() if device.startswith("cuda") else None,
        seconds=wall,
        whole_tokens_per_s=batch * generated / wall if generated else 0.0,
        decode_tokens_per_s=None,
    )
    steps = meter.times
    if generated >= 4:
        half = len(steps) // 2
        result["decode_tokens_per_s"] = batch * (len(steps) - 1 - half) / (steps[-1] - steps[half])
    del cache
    return result


def find_max_batch(probe: Callable[[int], dict], max_batch: int = 4096, guess: int = 1) -> dict:
    """Largest batch b with probe(b)["fits"], found by real runs.

    The search starts at `guess` (e.g. the cap over an estimate of one row's KV: only a starting
    point, every answer is a probe's outcome) and gallops: guess+1, +2, +4, ... while they fit, or
    guess-1, -2, -4, ... while they do not, then bisects. A right guess costs two probes (b, b+1).

    Returns fit (b, 0 when batch 1 is already over), over (b + 1, None when `max_batch` fits), their
    probe results (fit_result / over_result) and every probe in the order run. Assumes a batch that
    fits means every smaller one fits (resident KV grows with the batch).
    """
    runs: dict[int, dict] = {}

    def run(b: int) -> bool:
        runs[b] = probe(b)
        return bool(runs[b]["fits"])

    lo, hi = 0, None  # lo fits (0: nothing yet), hi does not
    guess, stride = min(max(1, guess), max_batch), 1
    if run(guess):
        lo = guess
        while hi is None and lo < max_batch:
            b = min(lo + stride, max_batch)
            if run(b):
                lo, stride = b, stride * 2
            else:
                hi = b
    else:
        hi = guess
        while hi - lo > 1:
            b = max(hi - stride, lo + 1)
            if run(b):
                lo = b
                break
            hi, stride = b, stride * 2
    while hi is not None and hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return dict(
        fit=lo,
        over=hi,
        fit_result=runs.get(lo),
        over_result=runs.get(hi) if hi is not None else None,
        probes=list(runs.values()),
    )


def kv_geometry(args) -> tuple[int, int, int, int, int]:
    """(layers, KV heads, head_dim, bytes per element, query heads per KV head) of the suite's model,
    without loading weights."""
    from transformers import AutoConfig, LlamaConfig

    from benchmarks.gpu.profile import GEOMETRIES, geometry_config
    from rlkv.geometry import attention_geometry
    from rlkv.inference import resolve_dtype
    from rlkv.testing import tiny_config

    spec = args.serve_model_spec
    if spec in GEOMETRIES:
        config = geometry_config(spec)
    elif spec == "synthetic":
        from benchmarks.common import ATTN_SHAPE

        config = LlamaConfig(num_hidden_layers=args.serve_layers, **ATTN_SHAPE)
    elif spec.startswith("tiny:"):
        config = tiny_config(spec.split(":", 1)[1])
    else:
        config = AutoConfig.from_pretrained(spec)
    g = attention_geometry(config)
    elem = torch.empty(0, dtype=resolve_dtype(args.dtype, args.device)).element_size()
    return g.num_hidden_layers, g.num_key_value_heads, g.head_dim, elem, g.num_groups


def row_kv_estimate(args, method: Method, geometry: tuple[int, int, int, int, int]) -> int:
    """Rough KV bytes of one row at the end of a probe: the search's starting point, never its answer.

    Full heads hold prompt + generated tokens; compressed heads (int32 position per slot) hold the
    protected prompt (when the suite protects it) plus the window (streaming) or the budget and one
    policy buffer, and the ring of observation queries a policy keeps (its window per query head).
    """

    from rlkv.inference import CompressionConfig
    from rlkv.policies import get_policy

    layers, kv_heads, dim, elem, groups = geometry
    heads, tokens, per_slot = layers * kv_heads, args.prompt_tokens + args.serve_tokens, 2 * dim * elem
    if method.policy is None:
        return heads * tokens * per_slot
    compressed = heads if method.sparsity is None else round(method.sparsity * heads)
    policy = get_policy(method.policy, **(method.policy_kwargs or {}))
    if method.policy == "streaming":
        kept = CompressionConfig.window
    else:
        kept = (method.budget or args.serve_budget) + getattr(policy, "buffer", 0)
    protected = args.prompt_tokens if protect_prompt(args.serve_model_spec) else 0
    kept = min(tokens, protected + kept)
    queries = groups * policy.observe_queries * dim * elem
    return (heads - compressed) * tokens * per_slot + compressed * (kept * (per_slot + 4) + queries)


# --------------------------------------------------------------------------------- recorded probes
def probe_log(args) -> Path:
    """The JSON-lines file under --out where the suite records finished probes."""
    out = Path(getattr(args, "out", None) or "runs/bench")
    out.mkdir(parents=True, exist_ok=True)
    return out / "serve_probes.jsonl"


def probe_key(args, method: Method) -> dict:
    """Everything a probe's outcome depends on besides its batch: a recorded probe is reused only
    under the same key."""
    keys = ("serve_model_spec", "serve_layers", "cap_bytes", "serve_tokens", "prompt_tokens")
    keys += ("serve_budget", "dtype", "device", "threads", "mask")
    return dict(method=method.name, **{k: getattr(args, k, None) for k in keys})


def recorded_probe(probe: Callable[[int], dict], path: Path, key: dict) -> Callable[[int], dict]:
    """probe(batch) that first looks in `path` for a result recorded under `key` and appends every new
    one as it finishes, so a killed suite reruns only the probes it had not finished (a line cut off
    by the kill is ignored)."""
    done: dict[int, dict] = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("key") == key:
            done[record["result"]["batch"]] = record["result"]

    def run(batch: int) -> dict:
        if batch in done:
            print(f"  serve: {key['method']} B={batch}: recorded in {path}", flush=True)
            return done[batch]
        result = probe(batch)
        with path.open("a") as f:
            f.write(json.dumps(dict(key=key, result=result)) + "\n")
        return result

    return run
