"""Step records on a real scheduler: pairing by output, drops, idleness, bounds.

Each ``schedule()`` opens a record of the prefix-cache entries it makes
(:class:`~vllm_prefix_guard.rules.uncommitted.UncommittedPrefixCache`, driven by the
scheduler's :class:`~vllm_prefix_guard.scheduler_guard.SchedulerGuard`); the output it
returns carries the record until ``update_from_output`` commits it.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard.scheduler_guard import SchedulerGuard
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import NEVER_WRITTEN, Driver


def guarded_driver(**spec: Any) -> tuple[Driver, SchedulerGuard]:
    scheduler = make_scheduler(**spec)
    guard = guard_of(scheduler)
    assert guard is not None
    return Driver(scheduler, depth=2 if spec.get("async_scheduling") else 1), guard


def test_step_that_never_comes_back_is_rolled_back(guard: None) -> None:
    """A dispatched step whose output is dropped (fault-tolerance drain) never wrote its
    blocks: its entries go when the next step commits."""
    driver, scheduler_guard = guarded_driver(num_blocks=40, async_scheduling=True)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    dropped = driver.scheduler.schedule()  # never executed, never updated
    assert scheduler_guard.pool.uncommitted_entries is None
    assert len(scheduler_guard.rules.step_id_to_entries) == 1
    registered = scheduler_guard.counters()["registrations_tracked"]
    assert registered == 4
    pool = driver.scheduler.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 4
    driver.schedule()
    driver.complete()
    assert scheduler_guard.stats.rolled_back_dropped_step == registered
    assert dropped is not None and len(scheduler_guard.rules.step_id_to_entries) == 0


def test_steps_in_flight_go_when_a_fault_finishes_every_request(mode: str) -> None:
    """vLLM's fault tolerance (``--enable-fault-tolerance``) after a fault in the engine
    loop: ``on_fault`` finishes every request and the drain passes empty outputs, so the
    step that failed never comes back. A request with the same prompt, the first after
    recovery, found its never-written blocks cached (stock, and the guard until rule 4:
    the step was undone only when a later one committed, after that lookup)."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
    from vllm.v1.request import RequestStatus

    scheduler = make_scheduler(num_blocks=40, async_scheduling=True)
    driver = Driver(scheduler, depth=2)
    prompt = list(range(1, 65))
    driver.add(make_request("a", [*prompt, 900], max_tokens=8))
    assert scheduler.schedule().num_scheduled_tokens  # its execution fails
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(SchedulerOutput.make_empty(), EMPTY_MODEL_RUNNER_OUTPUT)
    driver.add(make_request("b", [*prompt, 901], max_tokens=4))
    driver.run()
    if mode == "stock":
        assert driver.kv.counts[NEVER_WRITTEN] == len(prompt) * 4  # its hit, read in 4 steps
    else:
        assert driver.violations == 0
        guard = guard_of(scheduler)
        assert guard is None or guard.stats.rolled_back_dropped_step == 4


def test_foreign_output_is_ignored(guard: None) -> None:
    """``update_from_output`` with an output no ``schedule()`` returned (0.33's drain
    passes ``SchedulerOutput.make_empty()``) commits nothing and drops nothing."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    driver, scheduler_guard = guarded_driver(num_blocks=40)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    driver.schedule()
    driver.scheduler.update_from_output(SchedulerOutput.make_empty(), EMPTY_MODEL_RUNNER_OUTPUT)
    assert len(scheduler_guard.rules.step_id_to_entries) == 1
    assert scheduler_guard.stats.rolled_back == 0
    driver.complete()
    driver.run()
    assert scheduler_guard.is_idle and driver.violations == 0


def test_schedule_that_raises_is_undone_at_the_next_schedule(
    guard: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``schedule()`` that raised produced no step, and vLLM 0.34's fault tolerance
    (``enable_fault_tolerance``) resumes the engine loop after it: its entries stay in the
    open record, and the next ``schedule()`` removes them before it schedules anything."""
    driver, scheduler_guard = guarded_driver(num_blocks=40)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    scheduler = driver.scheduler
    pool = scheduler.kv_cache_manager.block_pool

    def failing_update_after_schedule(output: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(scheduler, "_update_after_schedule", failing_update_after_schedule)
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.schedule()
    assert pool.uncommitted_entries is not None  # the raised step's record, still open
    assert sum(len(entries) for entries in pool.uncommitted_entries.values()) == 4
    assert len(scheduler_guard.rules.step_id_to_entries) == 0
    assert scheduler_guard.stats.rolled_back_dropped_step == 0
    assert len(pool.cached_block_hash_to_block) == 4
    monkeypatch.undo()
    removed = pool.guard_removed
    scheduler.schedule()
    assert pool.guard_removed - removed == 4  # undone before it scheduled
    assert scheduler_guard.stats.rolled_back_dropped_step == 4


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_records_are_bounded_and_empty_when_idle(guard: None, async_scheduling: bool) -> None:
    driver, scheduler_guard = guarded_driver(
        num_blocks=64, max_num_batched_tokens=128, async_scheduling=async_scheduling
    )
    per_step_peak = 0
    for i in range(12):
        driver.add(make_request(f"r{i}", list(range(i, i + 90)), max_tokens=20))
    scheduler, stats = driver.scheduler, scheduler_guard.stats
    while scheduler.has_requests() or driver.in_flight:
        if len(driver.in_flight) < driver.depth and scheduler.has_requests():
            before = scheduler_guard.counters()["registrations_tracked"]
            driver.schedule()
            after = scheduler_guard.counters()["registrations_tracked"]
            per_step_peak = max(per_step_peak, after - before)
        assert len(scheduler_guard.rules.step_id_to_entries) <= driver.depth
        if driver.in_flight and (
            len(driver.in_flight) >= driver.depth or not scheduler.has_requests()
        ):
            driver.complete()
    assert scheduler_guard.is_idle and driver.violations == 0
    assert 0 < stats.peak_uncommitted_entries <= driver.depth * per_step_peak
