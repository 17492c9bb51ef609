"""Priority preemption of a request already scheduled in the same ``schedule()`` call.

The victim's ``allocate_slots`` registered hashes for blocks its step would have
written; the step is withdrawn, the blocks are freed, and the hashes stay. Layout from
the shared notes (``README.md``, "Findings"): D (short, priority 0) and A (long,
priority 1) run; B (priority 0) arrives; in the next step A is scheduled first,
registers its next blocks, B cannot allocate and A is the victim. C, with A's prompt,
arrives later. On stock vLLM C and the resumed A read a block that was never written.
"""

from __future__ import annotations

import functools
from itertools import pairwise
from typing import Any

import pytest

from layouts import fcfs_preemption, fcfs_preemption_two_in_flight, shrunk_async_priority
from native_fix import INSTALLED as NATIVE_FIX_INSTALLED
from native_fix import guard_only
from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.fuzz.runner import RunResult, run_workload
from vllm_prefix_guard_harness.fuzz.workload import Arrive, Workload
from vllm_prefix_guard_harness.notes_zombie import zombie_layout
from vllm_prefix_guard_harness.shadow_kv import NEVER_WRITTEN, Driver

LAYOUTS: dict[str, dict[str, Any]] = {
    "sync-block16": {},
    "sync-block32": {"block_size": 32},
    "async-scheduler-two-in-flight": {"async_scheduling": True},
    "batch-queue-sync-scheduler": {"depth": 2},
}


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_preempted_scheduled_request_leaves_no_zombie(mode: str, layout: dict[str, Any]) -> None:
    driver = zombie_layout(**layout)
    # A was scheduled (its entries registered) and then preempted in one schedule() call.
    assert any("A" in (out.preempted_req_ids or ()) for out in driver.outputs)
    if mode == "stock":
        assert driver.kv.counts[NEVER_WRITTEN] > 0
        assert "C" in {v.request_id for v in driver.kv.violations}
    else:
        assert driver.violations == 0


@guard_only("the guard's ledger")
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_guard_rolls_back_the_victims_entries(guard: None, layout: dict[str, Any]) -> None:
    scheduler_guard = guard_of(zombie_layout(**layout).scheduler)
    assert scheduler_guard is not None
    assert scheduler_guard.stats.rolled_back_preempted > 0
    assert scheduler_guard.is_idle


def test_resumed_victim_reads_zombie_on_stock(mode: str) -> None:
    """The victim itself, on resume, hits its own unwritten block (sync layout)."""
    driver = zombie_layout(c_arrives=99)
    readers = {v.request_id for v in driver.kv.violations}
    if mode == "stock":
        assert readers == {"A"}
    else:
        assert driver.violations == 0


def test_lookup_after_preemption_hits_only_written_blocks(mode: str) -> None:
    """Right after the preempting step, a lookup of A's prompt finds only the blocks A's
    dispatched chunks wrote (upstream #43569, test 7)."""
    driver = run_layout_until_preemption()
    probe = make_request("probe", list(range(1, 161)))
    num_hit_tokens = driver.scheduler.kv_cache_manager.get_computed_blocks(probe)[1]
    # A's two dispatched chunks wrote 128 tokens; stock also hands out the 9th block.
    assert num_hit_tokens == (144 if mode == "stock" else 128)


def run_layout_until_preemption() -> Driver:
    scheduler = make_scheduler(policy="priority", num_blocks=20, long_prefill_token_threshold=64)
    driver = Driver(scheduler)
    driver.add(make_request("D", list(range(1000, 1016)), max_tokens=3))
    driver.add(make_request("A", list(range(1, 161)), max_tokens=4, priority=1))
    driver.step()
    driver.add(make_request("B", list(range(2000, 2120)), max_tokens=4))
    driver.step()
    driver.step()
    assert driver.outputs[-1].preempted_req_ids == {"A"}
    return driver


def outcome(driver: Driver) -> tuple[int, int, int]:
    return driver.hit_tokens, driver.preemptions, driver.violations


def test_preemption_counts_and_hits_match_stock_under_fcfs() -> None:
    """FCFS never picks an already-scheduled victim: the guard changes nothing."""
    from vllm_prefix_guard import plugin

    stock = outcome(fcfs_preemption())
    plugin.apply()
    guarded = outcome(fcfs_preemption())
    assert stock[1] > 0  # the pool is small enough to preempt
    assert guarded == stock


def test_async_victims_with_steps_in_flight_keep_their_entries() -> None:
    """Two steps in flight: a victim whose previous step is still executing keeps that
    step's entries (it will write them). Hits and preemptions equal stock's (upstream
    #43569 would roll back every in-flight bucket of the victim)."""
    from vllm_prefix_guard import plugin

    stock = outcome(fcfs_preemption_two_in_flight())
    plugin.apply()
    driver = fcfs_preemption_two_in_flight()
    assert stock[1] > 0 and outcome(driver) == stock
    # Some victim was preempted while its previous step was still in flight.
    assert any(
        victim in earlier.num_scheduled_tokens
        for earlier, later in pairwise(driver.outputs)
        for victim in later.preempted_req_ids or ()
    )


@guard_only("the guard's ledger")
def test_async_victims_with_steps_in_flight_roll_nothing_back(guard: None) -> None:
    scheduler_guard = guard_of(fcfs_preemption_two_in_flight().scheduler)
    assert scheduler_guard is not None and scheduler_guard.is_idle
    assert scheduler_guard.stats.rolled_back == 0


#: Shrunk by the rollback audit (``priority-phased-async`` seed 2, vLLM 0.32).
ONE_STEP_LATE = Workload(
    spec=shrunk_async_priority(),
    depth=2,
    events=(
        Arrive(0, "r0", prompt=((1000, 103), (2000, 17)), max_tokens=20),
        Arrive(5, "r1", prompt=((1000, 103), (3000, 44)), max_tokens=18, priority=2),
        Arrive(7, "r2", prompt=((1000, 103), (4000, 12)), max_tokens=23),
        Arrive(8, "r3", prompt=((5000, 49), (6000, 18)), max_tokens=10),
        Arrive(10, "r4", prompt=((7000, 123), (8000, 27)), max_tokens=9),
        Arrive(13, "r5", prompt=((5000, 49), (9000, 33)), max_tokens=8),
        Arrive(13, "r6", prompt=((10000, 47),), max_tokens=10),
        Arrive(17, "r7", prompt=((1000, 103), (11000, 8)), max_tokens=6),
    ),
)


@functools.cache
def one_step_late() -> RunResult:
    """The guarded run, shared by the two tests below: the audit observes and never
    decides, so it is on wherever the guard's rules run (not on a vLLM with its own fix)."""
    return run_workload(ONE_STEP_LATE, "guard", audit=not NATIVE_FIX_INSTALLED)


def test_preempted_victim_keeps_a_block_registered_one_step_late() -> None:
    """Under async scheduling a decode block is registered one step after the step that
    writes it (its last token was sampled by a step still in flight). A priority victim
    preempted in that later step kept nothing: the old rule rolled back a block its
    dispatched step writes, valid KV the cache then lacked. The oracle's verdict (on a
    vLLM with its own fix, the fix's)."""
    result = one_step_late()
    assert result.violations == 0
    assert result.preemptions > 0


@guard_only("the rollback audit judges the guard's rules")
def test_one_step_late_block_is_neither_rolled_back_nor_committed_wrong() -> None:
    result = one_step_late()
    assert result.audit is not None
    assert result.audit.valid_rolled_back == 0, result.audit.examples
    assert result.audit.invalid_committed == 0, result.audit.examples
