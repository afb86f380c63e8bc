"""Rollout KV memory report: compressed vs full cache, measured in the same run.

`measure_rollout_memory(model, tokenizer, prompts, compression, max_new_tokens=..., kv_cap_bytes=...)`
samples rollouts the way GRPO does (`generate_rollouts`, temperature sampling, left padding) once
with a stock `DynamicCache` ("full") and once with the head-mixed compressed cache, and reports
per cache kind:
- the peak KV bytes of a rollout batch, read from tensor storage after every forward;
- the largest rollout batch whose peak fits under `kv_cap_bytes`, found by real runs: an
  estimate from the per-sequence peak, then probing batch sizes until batch b fits and b + 1
  does not (every probe is kept in the report);
- on CUDA, the peak allocator memory of the generate call above what was allocated before it
  (KV + activations + logits) and `torch.cuda.max_memory_allocated` itself (weights included);
- the importance-sampling ratio of the compressed rollouts: exp(log p_full - log p_rollout) of every
  sampled token of the compressed reference batch, log p_full from a teacher-forced forward with
  the model's own attention (what the GRPO loss evaluates, and TRL's per-token ratio before its
  truncation); exactly 1 where compression dropped nothing.
Every rollout runs the full `max_new_tokens` (EOS is suppressed): memory caps must hold for the
longest rollouts, and it makes both cache kinds see the same lengths.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationConfig

from rlkv._io import atomic_write_text
from rlkv.inference import CompressionConfig
from rlkv.rollout.generation import RolloutGenerator


@dataclass
class CacheMemory:
    """One cache kind ("full" or "compressed") under the cap.

    batch_size / peak_bytes / resident_bytes: the reference run (bytes of the whole batch);
    peak_bytes_per_sequence: peak_bytes / batch_size; max_batch: largest batch with peak <= cap
    (0 if not even one rollout fits); probes: batch size -> measured peak bytes;
    peak_device_bytes: CUDA allocator peak of the reference generate call above what was
    allocated before it (None on CPU); peak_allocated_bytes: `torch.cuda.max_memory_allocated`
    during that call, weights included (None on CPU).
    """

    name: str
    batch_size: int
    peak_bytes: int
    resident_bytes: int
    peak_bytes_per_sequence: float
    max_batch: int
    probes: dict[int, int] = field(default_factory=dict)
    peak_device_bytes: int | None = None
    peak_allocated_bytes: int | None = None


@dataclass
class ImportanceRatio:
    """exp(log p_full - log p_rollout) over the `tokens` sampled tokens of the compressed reference
    batch (min / mean / max), and the mean |log p_full - log p_rollout|."""

    tokens: int
    min: float
    mean: float
    max: float
    mean_abs_logp_diff: float


@dataclass
class RolloutMemoryReport:
    """Full vs compressed rollout KV memory for one model, prompt set, length and cap."""

    model: str
    kv_cap_bytes: int
    max_new_tokens: int
    prompt_tokens: list[int]
    compression: dict[str, Any]
    full: CacheMemory
    compressed: CacheMemory
    importance_ratio: ImportanceRatio | None = None
    device: str = "cpu"

    @property
    def peak_ratio(self) -> float:
        """Compressed / full peak KV bytes at the reference batch size."""
        return self.compressed.peak_bytes / self.full.peak_bytes

    @property
    def max_batch_ratio(self) -> float:
        """Compressed / full largest batch under the cap (inf if no full-cache rollout fits)."""
        return self.compressed.max_batch / self.full.max_batch if self.full.max_batch else float("inf")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict, ratios included."""
        return {**asdict(self), "peak_ratio": self.peak_ratio, "max_batch_ratio": self.max_batch_ratio}

    def save(self, path: str | os.PathLike) -> Path:
        """Write the report as JSON atomically."""
        return atomic_write_text(path, json.dumps(self.to_dict(), indent=1) + "\n")

    def to_markdown(self) -> str:
        """A small table: peak KV bytes per sequence, max batch under the cap, and the ratios."""
        mib = 2.0**20
        lines = [
            f"model {self.model}, {self.max_new_tokens} new tokens, prompts {min(self.prompt_tokens)}-"
            f"{max(self.prompt_tokens)} tokens, KV cap {self.kv_cap_bytes / mib:.2f} MiB, device {self.device}",
            "",
            "| cache | resident KV MiB | peak KV MiB (batch) | peak KV KiB / sequence | max batch under cap "
            "| generate peak MiB (above start) | max allocated MiB |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for m in (self.full, self.compressed):
            above = "-" if m.peak_device_bytes is None else f"{m.peak_device_bytes / mib:.1f}"
            total = "-" if m.peak_allocated_bytes is None else f"{m.peak_allocated_bytes / mib:.1f}"
            lines.append(
                f"| {m.name} | {m.resident_bytes / mib:.3f} | {m.peak_bytes / mib:.3f} ({m.batch_size}) "
                f"| {m.peak_bytes_per_sequence / 1024:.1f} | {m.max_batch} | {above} | {total} |"
            )
        lines += [
            "",
            f"peak ratio compressed/full {self.peak_ratio:.3f}; max-batch ratio {self.max_batch_ratio:.2f}",
        ]
        if (r := self.importance_ratio) is not None:
            lines.append(
                f"importance-sampling ratio p_full/p_rollout over {r.tokens} compressed-rollout tokens: min "
                f"{r.min:.4f}, mean {r.mean:.4f}, max {r.max:.4f} (mean |log-prob diff| {r.mean_abs_logp_diff:.4f})"
            )
        return "\n".join(lines)


class _RolloutProbe:
    """Runs rollout batches of a given size with one cache kind and remembers their peaks."""

    def __init__(
        self, model, prompt_ids, generation_config, compression, temperature, eos, seed, static_cache
    ):
        self.model, self.prompt_ids, self.generation_config = model, prompt_ids, generation_config
        self.temperature, self.eos, self.seed = temperature, eos, seed
        self.generator = RolloutGenerator(compression, static_cache)  # a static cache is kept between runs
        self.peaks: dict[int, int] = {}

    def run(self, batch_size: int):
        """One batch of `batch_size` rollouts: (its RolloutBatch, CUDA peak bytes above the start or None,
        torch.cuda.max_memory_allocated or None); its prompts are kept as `last_inputs`."""
        from trl.trainer.utils import pad

        device = next(self.model.parameters()).device
        rows = [torch.tensor(self.prompt_ids[i % len(self.prompt_ids)]) for i in range(batch_size)]
        input_ids = pad(rows, padding_value=self.generation_config.pad_token_id, padding_side="left").to(
            device
        )
        attention_mask = pad([torch.ones_like(r) for r in rows], padding_value=0, padding_side="left").to(
            device
        )
        on_cuda = device.type == "cuda"
        if on_cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        torch.manual_seed(self.seed)
        batch = self.generator(
            self.model,
            input_ids,
            attention_mask,
            self.generation_config,
            temperature=self.temperature,
            eos_token_ids=self.eos,
        )
        peak_allocated = torch.cuda.max_memory_allocated(device) if on_cuda else None
        self.peaks[batch_size] = batch.kv.peak_bytes
        self.last_inputs = (input_ids, attention_mask)
        return batch, None if peak_allocated is None else peak_allocated - before, peak_allocated

    def peak(self, batch_size: int) -> int:
        if batch_size not in self.peaks:
            self.run(batch_size)
        return self.peaks[batch_size]

    def max_batch(self, cap: int, per_sequence: float, limit: int) -> int:
        """Largest batch b <= limit with peak(b) <= cap, checked by running b and b + 1."""
        b = max(1, min(limit, int(cap // per_sequence)))
        if self.peak(b) <= cap:
            while b < limit and self.peak(b + 1) <= cap:
                b += 1
            return b
        while b > 0 and self.peak(b) > cap:
            b -= 1
        return b


def _mask_name(mask: Any) -> str | None:
    return None if mask is None else f"HeadMask of {mask.fingerprint.name_or_path}"


def measure_rollout_memory(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: list[str],
    compression: CompressionConfig,
    *,
    max_new_tokens: int,
    kv_cap_bytes: int,
    batch_size: int = 8,
    temperature: float = 1.0,
    seed: int = 0,
    max_batch_limit: int = 4096,
    static_cache: bool | None = None,
) -> RolloutMemoryReport:
    """Measure rollout KV memory with a full and a compressed cache (see the module docstring).

    prompts: user messages, rendered with the tokenizer's chat template and cycled to fill a
    batch. batch_size: rollouts in the reference run. kv_cap_bytes: the KV memory cap.
    max_batch_limit: stop probing above this batch size. static_cache: the compressed rollouts' cache,
    as `RolloutGenerator` takes it (None: the static-shape cache on CUDA, whose resident bytes are its
    allocated capacity); the report's `compression["cache"]` says which one ran.
    """
    if kv_cap_bytes <= 0 or batch_size < 1 or max_new_tokens < 1 or not prompts:
        raise ValueError(
            f"need kv_cap_bytes > 0, batch_size >= 1, max_new_tokens >= 1 and prompts; got {kv_cap_bytes}, "
            f"{batch_size}, {max_new_tokens}, {len(prompts)} prompts"
        )
    prompt_ids = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for p in prompts
    ]
    eos = tokenizer.eos_token_id
    generation_config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
        eos_token_id=eos,
    )
    results, ratio = {}, None
    for name, cache_config in (("full", None), ("compressed", compression)):
        probe = _RolloutProbe(
            model,
            prompt_ids,
            generation_config,
            cache_config,
            temperature,
            [eos],
            seed,
            None if cache_config is None else static_cache,
        )
        batch, device_peak, peak_allocated = probe.run(batch_size)
        kv = batch.kv
        if cache_config is not None:
            ratio = importance_ratio(model, *probe.last_inputs, batch, temperature)
            kind = "static" if probe.generator.kept_static_cache is not None else "dynamic"
        per_sequence = kv.peak_bytes / batch_size
        max_batch = probe.max_batch(kv_cap_bytes, per_sequence, max_batch_limit)
        results[name] = CacheMemory(
            name=name,
            batch_size=batch_size,
            peak_bytes=kv.peak_bytes,
            resident_bytes=kv.resident_bytes,
            peak_bytes_per_sequence=per_sequence,
            max_batch=max_batch,
            probes=dict(sorted(probe.peaks.items())),
            peak_device_bytes=device_peak,
            peak_allocated_bytes=peak_allocated,
        )
    config = getattr(model, "config", None)
    mask = compression.head_mask
    return RolloutMemoryReport(
        model=str(getattr(config, "name_or_path", "") or type(model).__name__),
        kv_cap_bytes=int(kv_cap_bytes),
        max_new_tokens=max_new_tokens,
        prompt_tokens=[len(ids) for ids in prompt_ids],
        compression={
            "head_mask": str(mask) if isinstance(mask, (str, os.PathLike)) else _mask_name(mask),
            "sparsity": compression.sparsity,
            "policy": compression.policy,
            "policy_kwargs": compression.policy_kwargs,
            "budget": compression.budget,
            "sink": compression.sink,
            "window": compression.window,
            "protect_prompt": compression.protect_prompt,
            "cache": kind,
        },
        full=results["full"],
        compressed=results["compressed"],
        importance_ratio=ratio,
        device=str(next(model.parameters()).device),
    )


def full_attention_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """log_softmax(logits / temperature) [B, N] of `completion_ids` [B, N] after the left-padded prompts
    `input_ids` [B, P], teacher-forced with the model's own attention (no cache), one row at a time so
    at most one row's [N, vocab] logits exist."""
    sequences = torch.cat([input_ids, completion_ids], dim=1)
    mask = torch.cat([attention_mask, torch.ones_like(completion_ids)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # left padding: the positions generate used
    num = completion_ids.shape[1]
    rows = []
    with torch.no_grad():
        for i in range(sequences.shape[0]):
            logits = model(
                input_ids=sequences[i : i + 1],
                attention_mask=mask[i : i + 1],
                position_ids=positions[i : i + 1],
                use_cache=False,
                logits_to_keep=num + 1,
            ).logits[:, :-1]
            logp = torch.log_softmax(logits.float() / temperature, dim=-1)
            rows.append(logp.gather(-1, completion_ids[i : i + 1, :, None]).squeeze(-1))
    return torch.cat(rows)


def importance_ratio(
    model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, batch, temperature: float
) -> ImportanceRatio:
    """`ImportanceRatio` of a compressed `RolloutBatch` sampled from `input_ids` / `attention_mask`."""
    completion = torch.tensor(batch.completion_ids, device=input_ids.device)  # EOS suppressed: equal lengths
    full = full_attention_logprobs(model, input_ids, attention_mask, completion, temperature)
    diff = full - torch.tensor(batch.logprobs, device=full.device)
    ratio = diff.exp()
    return ImportanceRatio(
        tokens=diff.numel(),
        min=ratio.min().item(),
        mean=ratio.mean().item(),
        max=ratio.max().item(),
        mean_abs_logp_diff=diff.abs().mean().item(),
    )
