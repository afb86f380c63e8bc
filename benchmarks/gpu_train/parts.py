"""Measurement helpers of the gpu-train suite (benchmarks/gpu_train/runner.py): timed parts with peak
allocated memory, host-sync and kernel-launch counts, a decode-step probe, and a GRPO trainer
subclass that times its own rollout, log-prob, loss and training-step parts."""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator

import torch

from rlkv.compat import cache_kwargs

LAUNCH_EVENTS = {
    "cudaLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
}
PROBE_STEPS = 8  # decode steps per probe measurement


# ------------------------------------------------------------------------------- measurement
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PartTimer:
    """Wall seconds and peak allocated bytes of named, possibly nested parts of a run.

    Peaks are `torch.cuda.max_memory_allocated` since a part began (None on CPU): each part resets
    the allocator's peak when it starts, after folding the peak so far into every open part and
    into `overall_peak`, so nested parts and the whole run keep their true maxima.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.records: dict[str, list[dict]] = defaultdict(list)
        self.overall_peak: int | None = 0 if device.type == "cuda" else None
        self._open: list[dict] = []

    def _fold(self) -> None:
        if self.device.type != "cuda":
            return
        peak = torch.cuda.max_memory_allocated(self.device)
        for record in self._open:
            record["peak_bytes"] = max(record["peak_bytes"], peak)
        self.overall_peak = max(self.overall_peak, peak)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[dict]:
        """Time the block as `name`; yields its record (seconds and peak_bytes are filled on exit)."""
        synchronize(self.device)
        self._fold()
        record: dict = {"peak_bytes": None}
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            record["peak_bytes"] = torch.cuda.memory_allocated(self.device)
        self._open.append(record)
        started = time.perf_counter()
        try:
            yield record
        finally:
            synchronize(self.device)
            record["seconds"] = time.perf_counter() - started
            self._fold()
            self._open.remove(record)
            self.records[name].append(record)

    def seconds(self, name: str) -> float:
        """Total seconds of every `name` part (0 if none ran)."""
        return sum(r["seconds"] for r in self.records.get(name, []))

    def peak(self, name: str) -> int | None:
        """Largest peak of the `name` parts (None on CPU or if none ran)."""
        peaks = [r["peak_bytes"] for r in self.records.get(name, []) if r["peak_bytes"] is not None]
        return max(peaks) if peaks else None


def count_host_syncs(fn: Callable[[], None], device: torch.device) -> int:
    """Host syncs made by `fn()`: `torch.cuda.set_sync_debug_mode("warn")` warnings on CUDA,
    `rlkv.testing.HostSyncCounter` (host-reading tensor methods) on CPU."""
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchronizing" in str(w.message) for w in caught)
    from rlkv.testing import HostSyncCounter

    with HostSyncCounter() as counter:
        fn()
    return counter.count


def count_kernel_launches(fn: Callable[[], None], device: torch.device) -> int | None:
    """CUDA kernel launches (runtime/driver launch calls, graph launches) made by `fn()`; None on CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        synchronize(device)
    return sum(e.count for e in prof.key_averages() if e.key in LAUNCH_EVENTS)


def decode_probe(model, make_cache: Callable[[], object], batch: int, prompt_tokens: int, vocab: int) -> dict:
    """Per single-token decode forward with the rollout's cache: seconds, host syncs, kernel launches.

    Prefills `batch` random prompts of `prompt_tokens`, warms up 2 steps, then measures
    PROBE_STEPS steps three times (timed, sync-counted, profiled) on one growing cache.
    """
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()  # as in a rollout
    generator = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, vocab, (batch, prompt_tokens), generator=generator).to(device)
    with torch.no_grad():
        cache = make_cache()
        with PartTimer(device).part("prefill") as prefill:
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(cache))
        state = {"next": out.logits[:, -1:].argmax(-1)}

        def steps(n: int = PROBE_STEPS) -> None:
            for _ in range(n):
                logits = model(input_ids=state["next"], use_cache=True, **cache_kwargs(cache)).logits
                state["next"] = logits[:, -1:].argmax(-1)

        steps(2)
        timer = PartTimer(device)
        with timer.part("decode"):
            steps()
        syncs = count_host_syncs(steps, device)
        launches = count_kernel_launches(steps, device)
    model.train(was_training)
    return dict(
        prefill_seconds=prefill["seconds"],
        seconds_per_step=timer.seconds("decode") / PROBE_STEPS,
        host_syncs_per_step=syncs / PROBE_STEPS,
        kernel_launches_per_step=None if launches is None else launches / PROBE_STEPS,
    )


def timed_trainer(cls: type, timer: PartTimer) -> type:
    """A subclass of the GRPO trainer `cls` that times its parts in `timer` and keeps the step's
    rollout arguments and loss inputs (for the side-by-side plain rollout and log-prob pass)."""

    class Timed(cls):
        rollout_call: tuple | None = None
        loss_inputs: list[dict] = []

        def _generate_single_turn(self, *args, **kwargs):
            self.rollout_call = (args, kwargs)
            with timer.part("rollout") as record:
                completion_ids, logprobs = super()._generate_single_turn(*args, **kwargs)
                record["tokens"] = sum(len(ids) for ids in completion_ids)
            return completion_ids, logprobs

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            with timer.part("logps_no_grad" if not torch.is_grad_enabled() else "logps_grad"):
                return super()._get_per_token_logps_and_entropies(*args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            with timer.part("generate_and_score"):
                return super()._generate_and_score_completions(inputs)

        def _compute_loss(self, model, inputs):
            self.loss_inputs = [*self.loss_inputs, inputs]  # one per micro-batch (an instance list)
            with timer.part("loss_forward"):
                return super()._compute_loss(model, inputs)

        def training_step(self, *args, **kwargs):
            with timer.part("training_step"):
                return super().training_step(*args, **kwargs)

    return Timed


def step_callback(timer: PartTimer):
    """A TrainerCallback timing each optimizer step (training step + optimizer) as part "step"."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.part = timer.part("step")
            self.part.__enter__()

        def on_step_end(self, *args, **kwargs):
            self.part.__exit__(None, None, None)

    return StepTimer()


def rollout_part(timer: PartTimer, index: int) -> dict:
    """Seconds, generated tokens, tokens/s and peak bytes of the index-th rollout the timer saw."""
    record = timer.records["rollout"][index]
    return dict(
        seconds=record["seconds"],
        tokens=record["tokens"],
        tokens_per_second=record["tokens"] / record["seconds"],
        peak_bytes=record["peak_bytes"],
    )


def step_parts(timer: PartTimer) -> dict:
    """The parts of the one GRPO step `timer` saw: rollout, log-prob passes, loss forward, backward."""
    training = timer.seconds("training_step")
    loss_forward = timer.seconds("loss_forward")
    return dict(
        step_seconds=timer.seconds("step"),
        step_peak_bytes=timer.peak("step"),
        rollout_seconds=timer.records["rollout"][0]["seconds"],
        logps_passes=len(timer.records.get("logps_no_grad", [])),
        logps_seconds=timer.seconds("logps_no_grad"),
        loss_forward_seconds=loss_forward,
        # training_step = generation and scoring (its first micro-step) + loss forward + backward
        backward_seconds=training - timer.seconds("generate_and_score") - loss_forward,
        loss_peak_bytes=timer.peak("loss_forward"),
    )


def logged(trainer, key: str) -> float | None:
    """The last value TRL logged under `key` (None if never)."""
    values = [record[key] for record in trainer.state.log_history if key in record]
    return values[-1] if values else None
