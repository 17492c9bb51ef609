"""Step ledger lifecycle on a real scheduler: pairing by output, drops, idleness, bounds."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.shadow_kv import Driver
from vllm_prefix_guard.hooks import ledger_of
from vllm_prefix_guard.ledger import StepLedger


def guarded_driver(**spec: Any) -> tuple[Driver, StepLedger]:
    scheduler = make_scheduler(**spec)
    ledger = ledger_of(scheduler)
    assert ledger is not None
    return Driver(scheduler, depth=2 if spec.get("async_scheduling") else 1), ledger


def test_step_that_never_comes_back_is_rolled_back(guard: None) -> None:
    """A dispatched step whose output is dropped (fault-tolerance drain) never wrote its
    blocks: its entries go when the next step commits."""
    driver, ledger = guarded_driver(num_blocks=40, async_scheduling=True)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    dropped = driver.scheduler.schedule()  # never executed, never updated
    assert ledger.open is None and ledger.steps_in_flight == 1
    registered = ledger.stats.registrations_tracked
    assert registered == 4
    pool = driver.scheduler.kv_cache_manager.block_pool
    assert len(pool.cached_block_hash_to_block) == 4
    driver.schedule()
    driver.complete()
    assert ledger.stats.rolled_back_dropped_step == registered
    assert dropped is not None and ledger.steps_in_flight == 0


def test_foreign_output_is_ignored(guard: None) -> None:
    """``update_from_output`` with an output the ledger never dispatched (0.33's drain
    passes ``SchedulerOutput.make_empty()``) commits nothing and drops nothing."""
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT

    driver, ledger = guarded_driver(num_blocks=40)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    driver.schedule()
    driver.scheduler.update_from_output(SchedulerOutput.make_empty(), EMPTY_MODEL_RUNNER_OUTPUT)
    assert ledger.steps_in_flight == 1 and ledger.stats.rolled_back == 0
    driver.complete()
    driver.run()
    assert ledger.is_idle and driver.violations == 0


def test_schedule_that_raises_abandons_its_step(
    guard: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    driver, ledger = guarded_driver(num_blocks=40)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=8))
    scheduler = driver.scheduler

    def failing_update_after_schedule(output: Any) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(scheduler, "_update_after_schedule", failing_update_after_schedule)
    with pytest.raises(RuntimeError, match="boom"):
        scheduler.schedule()
    assert ledger.open is None and ledger.stats.rolled_back_dropped_step == 4
    assert len(scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ledger_is_bounded_and_empty_when_idle(guard: None, async_scheduling: bool) -> None:
    driver, ledger = guarded_driver(
        num_blocks=64, max_num_batched_tokens=128, async_scheduling=async_scheduling
    )
    per_step_peak = 0
    for i in range(12):
        driver.add(make_request(f"r{i}", list(range(i, i + 90)), max_tokens=20))
    scheduler, stats = driver.scheduler, ledger.stats
    while scheduler.has_requests() or driver.in_flight:
        if len(driver.in_flight) < driver.depth and scheduler.has_requests():
            before = stats.registrations_tracked
            driver.schedule()
            per_step_peak = max(per_step_peak, stats.registrations_tracked - before)
        assert ledger.steps_in_flight <= driver.depth
        if driver.in_flight and (
            len(driver.in_flight) >= driver.depth or not scheduler.has_requests()
        ):
            driver.complete()
    assert ledger.is_idle and driver.violations == 0
    assert 0 < ledger.stats.peak_uncommitted_entries <= driver.depth * per_step_peak
