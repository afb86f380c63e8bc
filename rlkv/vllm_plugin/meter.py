"""KV blocks in use, measured by vLLM's own scheduler: `KVMeteredScheduler` (pass as `scheduler_cls`;
it keeps vLLM's async scheduling on where vLLM turned it on).

vLLM allocates KV memory as blocks from one pool; a request holds blocks in every KV cache group
(rlkv's split: full-attention groups and sliding-window groups, `attention.py`). After each
`schedule()` the subclass reads how many pool blocks are in use and how many blocks a full cache would
hold for the same requests (each running request's computed plus scheduled tokens, in blocks), and
keeps the peak of each since `reset_meter()`. Bytes come from the groups' specs (a pool block is a page
in each layer of one group; the groups' buffers overlay one another, so the buffer sizes would count
each byte once per group).
Blocks of finished requests kept only for prefix caching count as free, as they do for vLLM.

`engine_meter(llm)` finds the scheduler of an in-process engine (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
or the `external_launcher` executor TRL's colocate mode uses); None when the engine core runs in
another process.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from rlkv.vllm_plugin.fence import in_process_scheduler


@dataclass(frozen=True)
class KVMeterReading:
    """Peak KV memory since the last reset.

    peak_blocks: pool blocks in use (all groups); block_bytes: one pool block (a page in each layer of
    its group). peak_full_blocks: blocks a full cache (every layer and head, one group) would hold for the
    same requests; full_block_bytes: one such block (a page of every KV head of every layer).
    """

    peak_blocks: int
    block_bytes: int
    peak_full_blocks: int
    full_block_bytes: int
    num_groups: int
    steps: int

    @property
    def peak_bytes(self) -> int:
        """Peak bytes of KV blocks in use."""
        return self.peak_blocks * self.block_bytes

    @property
    def full_bytes(self) -> int:
        """Peak bytes a full KV cache would hold for the same requests."""
        return self.peak_full_blocks * self.full_block_bytes

    @property
    def ratio(self) -> float:
        """peak_bytes / full_bytes (1.0 when nothing ran)."""
        return self.peak_bytes / self.full_bytes if self.full_bytes else 1.0


class KVMeteredScheduler(Scheduler):
    """vLLM's scheduler, also recording the peak KV blocks in use and their full-cache equivalent.

    With async scheduling on (`scheduler_config.async_scheduling`, as vLLM resolved it) it is built as
    `AsyncKVMeteredScheduler`, so passing it as `scheduler_cls` leaves vLLM's async scheduling on (vLLM
    serves a custom scheduler class as given: a synchronous one would turn async scheduling off).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> KVMeteredScheduler:
        vllm_config = kwargs["vllm_config"] if "vllm_config" in kwargs else args[0]
        if cls is KVMeteredScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = AsyncKVMeteredScheduler
        return super().__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_meter()

    def reset_meter(self) -> None:
        """Start a new measurement (peaks back to zero)."""
        self._peak_blocks = self._peak_full_blocks = self._steps = 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        output = super().schedule(*args, **kwargs)
        pool = self.kv_cache_manager.block_pool
        in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()  # block 0 is vLLM's null block
        scheduled = output.num_scheduled_tokens
        full = sum(
            math.ceil((r.num_computed_tokens + scheduled.get(r.request_id, 0)) / self.block_size)
            for r in self.running
        )
        self._peak_blocks = max(self._peak_blocks, in_use)
        self._peak_full_blocks = max(self._peak_full_blocks, full)
        self._steps += 1
        return output

    def meter_reading(self) -> KVMeterReading:
        """The peaks since the last `reset_meter()`."""
        groups = self.kv_cache_config.kv_cache_groups
        group_bytes = [g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups]
        return KVMeterReading(
            peak_blocks=self._peak_blocks,
            block_bytes=max(group_bytes),
            peak_full_blocks=self._peak_full_blocks,
            full_block_bytes=sum(group_bytes),
            num_groups=len(groups),
            steps=self._steps,
        )


class AsyncKVMeteredScheduler(KVMeteredScheduler, AsyncScheduler):
    """vLLM's async scheduler with `KVMeteredScheduler`'s meter (what `KVMeteredScheduler` builds under async
    scheduling)."""


def engine_meter(llm: Any) -> KVMeteredScheduler | None:
    """The metered scheduler of `llm` (a `vllm.LLM`) when its engine core runs in this process, else None."""
    scheduler = in_process_scheduler(llm)
    return scheduler if isinstance(scheduler, KVMeteredScheduler) else None
