"""The scheduler-level layouts more than one test runs: built once, here.

Every test that builds a real scheduler builds it with
:func:`vllm_prefix_guard.diagnostics.factory.make_scheduler`; the layouts below are the
ones two test files share (the regression tests on vLLM's pool, and ``tests/kvcached``
on kvcached's, in its own interpreter, which has this directory on its path). Each
returns the :class:`~vllm_prefix_guard.diagnostics.shadow_kv.Driver` it ran, whose
shadow KV holds the verdict; what a test asserts stays in the test.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_prefix_guard.diagnostics.factory import SchedulerSpec, make_request, make_scheduler
from vllm_prefix_guard.diagnostics.fuzz.workload import Arrive, Workload
from vllm_prefix_guard.diagnostics.shadow_kv import Driver

#: 4 blocks of 16 tokens; the fake connector holds the first 3.
FAILED_LOAD_PROMPT = list(range(1, 65))

#: The scheduler the fuzzer's shrunk async-priority findings run on (``priority-phased-async``,
#: ``everything-async``); a finding adds what it needs (a load-failure policy).
SHRUNK_ASYNC_PRIORITY = SchedulerSpec(
    num_blocks=40,
    max_model_len=4096,
    policy="priority",
    long_prefill_token_threshold=64,
    async_scheduling=True,
)


def shrunk_async_priority(**overrides: Any) -> SchedulerSpec:
    return dataclasses.replace(SHRUNK_ASYNC_PRIORITY, **overrides)


#: The notes' deterministic zombie layout (``diagnostics.selftest.zombie_layout``) as the
#: fuzzer's events: D and A run, B arrives, A is preempted in the step that scheduled it,
#: C (and A on resume) hit A's block 8, which A's withdrawn step registered but never wrote.
ZOMBIE_SPEC = SchedulerSpec(num_blocks=20, policy="priority", long_prefill_token_threshold=64)
ZOMBIE_ARRIVALS = (
    Arrive(0, "D", ((1000, 16),), 3),
    Arrive(0, "A", ((1, 160),), 4, priority=1),
    Arrive(1, "B", ((2000, 120),), 4),
    Arrive(3, "C", ((1, 160),), 4, priority=1),
)


def zombie_workload(*more: Any) -> Workload:
    """The zombie layout as a one-step-in-flight workload, with ``more`` events after it."""
    return Workload(ZOMBIE_SPEC, 1, (*ZOMBIE_ARRIVALS, *more))


def failed_sync_load(policy: str, abort_before_update: bool) -> Driver:
    """Request ``r`` loads 48 of its 64 tokens from the connector in one step and the load
    fails (``policy``: vLLM's ``kv_load_failure_policy``), ``r`` optionally aborted while
    that step runs; then ``s``, with the same prompt, arrives and everything runs out."""
    scheduler = make_scheduler(
        num_blocks=40, kv_load_failure_policy=policy, long_prefill_token_threshold=16
    )
    scheduler.connector.external_tokens["r"] = 48
    scheduler.connector.fail_loads.add("r")
    driver = Driver(scheduler)
    driver.add(make_request("r", FAILED_LOAD_PROMPT, max_tokens=4))
    output = driver.schedule()
    assert output.num_scheduled_tokens == {"r": 16}  # 48 tokens come from the connector
    if abort_before_update:
        driver.abort("r")
    driver.complete()
    driver.add(make_request("s", FAILED_LOAD_PROMPT, max_tokens=4))
    driver.run()
    return driver


def failed_load_two_in_flight() -> tuple[Driver, int]:
    """``AsyncScheduler``, two steps in flight: ``r``'s load fails while the step after it,
    already dispatched, computes (and registers) more of its prompt over the invalid KV;
    then ``s`` with the same prompt. Returns the driver and how many blocks ``r`` computed
    over the invalid KV in the two steps."""
    scheduler = make_scheduler(
        num_blocks=40,
        kv_load_failure_policy="recompute",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        async_scheduling=True,
    )
    scheduler.connector.external_tokens["r"] = 48
    scheduler.connector.fail_loads.add("r")
    driver = Driver(scheduler, depth=2)
    prompt = list(range(1, 97))
    driver.add(make_request("r", prompt, max_tokens=4))
    failing = driver.schedule()
    following = driver.schedule()
    # Blocks 3-4 (vLLM >= 0.31 lifts long_prefill_token_threshold for a lone request) or
    # block 3 only (vLLM 0.30 caps it), over the invalid prefix; then one more block.
    assert failing.num_scheduled_tokens["r"] in (16, 32)
    assert following.num_scheduled_tokens == {"r": 16}
    computed_blocks = (failing.num_scheduled_tokens["r"] + 16) // 16
    driver.complete()
    driver.add(make_request("s", prompt, max_tokens=4))
    driver.run()
    return driver, computed_blocks


def fcfs_preemption() -> Driver:
    """FCFS on a pool small enough to preempt (never an already-scheduled victim): eight
    requests over one 96-token prefix, sync ``Scheduler``."""
    driver = Driver(
        make_scheduler(num_blocks=24, max_num_batched_tokens=128, long_prefill_token_threshold=48)
    )
    prefix = list(range(1, 97))
    for i in range(8):
        driver.add(make_request(f"r{i}", prefix + [500 + i] * (16 + 8 * i), max_tokens=12))
    driver.run()
    return driver


def fcfs_preemption_two_in_flight() -> Driver:
    """FCFS, ``AsyncScheduler`` with two steps in flight: victims preempted while their
    previous step still executes."""
    scheduler = make_scheduler(
        num_blocks=28,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=32,
        async_scheduling=True,
    )
    driver = Driver(scheduler, depth=2)
    prefix = list(range(1, 65))
    for i in range(10):
        driver.add(make_request(f"r{i}", prefix + [700 + i] * (8 + 8 * i), max_tokens=24))
    driver.run()
    return driver
