"""Upstream PR #43569's tests (``tests/v1/core/test_eager_cache_zombie.py``), re-expressed.

The PR's tests drive ``KVCacheManager`` and its ``begin_step``/``rollback_uncommitted``
API; here the same situations drive the real manager with the guard's rules (or, on
stock, without them) and assert both ways. Test 7 (preemption through the real
``schedule()``) lives in ``test_preemption.py``; the PR's all-bucket rollback on
preemption is deliberately *not* reproduced (test 6 pins the difference).
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard.pool import attach
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard.scheduler_guard import SchedulerGuard
from vllm_prefix_guard_harness.factory import (
    SchedulerSpec,
    kv_cache_config,
    make_request,
    make_scheduler,
)
from vllm_prefix_guard_harness.shadow_kv import Driver


def _manager_and_guard(mode: str, **spec: Any) -> tuple[Any, SchedulerGuard | None]:
    scheduler = make_scheduler(**spec)
    return scheduler.kv_cache_manager, guard_of(scheduler)


def _hashed(pool: Any) -> int:
    return len(pool.cached_block_hash_to_block)


def test_rollback_evicts_preempt_zombies(mode: str) -> None:
    """PR test 1: entries registered for a step that never runs do not survive free()."""
    manager, guard = _manager_and_guard(mode, num_blocks=11)
    a = make_request("a", list(range(1, 33)))
    if guard is not None:
        guard.begin_step()
    manager.allocate_slots(a, 32)
    blocks = manager.get_blocks("a").blocks[0]
    if guard is not None:
        open_entries = guard.pool.uncommitted_entries
        assert open_entries is not None and len(open_entries["a"]) == 2
        guard.preempted(a)
    manager.free(a)
    superset = make_request("b", list(range(1, 33)) + [99] * 16)
    num_hit_tokens = manager.get_computed_blocks(superset)[1]
    if mode == "stock":
        assert _hashed(manager.block_pool) == 2 and num_hit_tokens == 32
        return
    assert _hashed(manager.block_pool) == 0 and num_hit_tokens == 0
    assert all(b.block_hash is None and b.ref_cnt == 0 for b in blocks)


def _hybrid_manager(mode: str) -> tuple[Any, UncommittedPrefixCache | None]:
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    config = kv_cache_config(SchedulerSpec(num_blocks=30, mamba_align=True))
    manager = KVCacheManager(
        config, max_model_len=1024, scheduler_block_size=16, hash_block_size=16
    )
    if mode != "guard":
        return manager, None
    attach(manager.block_pool)
    return manager, UncommittedPrefixCache(manager)


def test_rollback_covers_hybrid_attention_and_mamba_groups(mode: str) -> None:
    """PR test 2: every group's eager entries go, full attention and Mamba alike."""
    manager, rules = _hybrid_manager(mode)
    a = make_request("a", list(range(1, 49)))
    if rules is not None:
        rules.begin_step()
    manager.new_step_starts()
    assert manager.allocate_slots(a, 48) is not None
    pool = manager.block_pool
    groups = {key[-4:] for key in pool.cached_block_hash_to_block._cache}
    assert len(groups) == 2  # both groups registered eagerly
    if rules is not None:
        rules.rollback_preempted("a", a.num_computed_tokens)
    manager.free(a)
    assert _hashed(pool) == (4 if mode == "stock" else 0)


def test_normal_finish_keeps_committed_entries(guard: None) -> None:
    """PR test 3: a committed step's entries survive the finish path's free()."""
    scheduler = make_scheduler(num_blocks=11)
    driver = Driver(scheduler)
    driver.add(make_request("a", list(range(1, 33)), max_tokens=1))
    driver.run()
    scheduler_guard = guard_of(scheduler)
    assert scheduler_guard is not None and scheduler_guard.is_idle
    assert _hashed(scheduler.kv_cache_manager.block_pool) == 2
    assert scheduler_guard.stats.rolled_back == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_confirmed_registrations_are_not_tracked(
    guard: None, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PR test 4 (``committed=True``): only ``allocate_slots`` registrations are tracked.

    Registrations made by ``update_from_output`` (0.33) or the async scheduler's output
    path (0.32) happen after the step's output arrived; they must never be rolled back.
    """
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    inside = {"depth": 0, "outside_records": 0}
    allocate_slots = KVCacheManager.allocate_slots

    def counting_allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
        inside["depth"] += 1
        try:
            return allocate_slots(self, *args, **kwargs)
        finally:
            inside["depth"] -= 1

    def num_recorded(pool: Any) -> int:
        entries = pool.uncommitted_entries
        return -1 if entries is None else sum(map(len, entries.values()))

    def checking(wrapper: Any) -> Any:
        """The guard's wrapper of a registering method, counting what it records outside
        ``allocate_slots`` (each wrapper records its own way)."""

        def call(self: Any, *args: Any, **kwargs: Any) -> Any:
            before = num_recorded(self)
            try:
                return wrapper(self, *args, **kwargs)
            finally:
                if not inside["depth"] and num_recorded(self) > max(before, 0):
                    inside["outside_records"] += 1

        return call

    monkeypatch.setattr(KVCacheManager, "allocate_slots", counting_allocate_slots)
    for name in ("cache_full_blocks", "cache_partial_block", "move_block_hashes"):
        monkeypatch.setattr(BlockPool, name, checking(getattr(BlockPool, name)))
    scheduler = make_scheduler(num_blocks=40, async_scheduling=async_scheduling)
    driver = Driver(scheduler, depth=2 if async_scheduling else 1)
    for i in range(3):
        driver.add(make_request(f"r{i}", list(range(1, 71)), max_tokens=40))
    driver.run()
    scheduler_guard = guard_of(scheduler)
    assert scheduler_guard is not None
    assert scheduler_guard.counters()["registrations_tracked"] > 0
    assert inside["outside_records"] == 0
    assert driver.violations == 0 and scheduler_guard.is_idle


def test_reset_prefix_cache_clears_the_records(guard: None) -> None:
    """PR test 5: after a reset no stale entry can later unregister a reused block."""
    scheduler = make_scheduler(num_blocks=40, async_scheduling=True)
    driver = Driver(scheduler, depth=2)
    for i in range(2):
        driver.add(make_request(f"r{i}", list(range(1, 81)), max_tokens=30))
    driver.step()
    driver.step()
    scheduler_guard = guard_of(scheduler)
    assert scheduler_guard is not None and len(scheduler_guard.rules.step_id_to_entries) >= 1
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    rules = scheduler_guard.rules
    assert len(rules.step_id_to_entries) == 0 and not rules.steps_in_flight()
    driver.run()
    assert driver.violations == 0 and scheduler_guard.is_idle


def test_steps_in_flight_commit_in_order_and_survive_abort(mode: str) -> None:
    """PR test 6: with two steps in flight, ``update_from_output`` commits only its own
    step; aborting a request whose step is in flight keeps its entries, because that
    step still writes them (the PR would roll them back and lose valid hits)."""
    scheduler = make_scheduler(num_blocks=40, async_scheduling=True)
    driver = Driver(scheduler, depth=2)
    prompt = list(range(1, 33))
    driver.add(make_request("a", prompt, max_tokens=8))
    driver.add(make_request("b", list(range(500, 532)), max_tokens=8))
    driver.schedule()
    driver.schedule()
    guard = guard_of(scheduler)
    if guard is not None:
        assert len(guard.rules.step_id_to_entries) == 2
    driver.abort("b")
    driver.complete()
    if guard is not None:
        assert len(guard.rules.step_id_to_entries) == 1
    driver.run()
    late = make_request("late", list(range(500, 532)) + [7] * 16)
    num_hit_tokens = scheduler.kv_cache_manager.get_computed_blocks(late)[1]
    assert num_hit_tokens == 32  # b's blocks were written and stay hittable
    assert driver.violations == 0
    if guard is not None:
        assert guard.is_idle and guard.stats.rolled_back == 0
