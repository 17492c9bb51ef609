"""The shrinker turns a failing run into a few-line reproducer that still fails."""

from __future__ import annotations

import pytest

from layouts import (
    PREEMPTED_WITH_ITS_BLOCK_WRITTEN_IN_FLIGHT,
    ZOMBIE_ARRIVALS,
    every_preempted_entry_goes,
    zombie_workload,
)
from native_fix import guard_only
from vllm_prefix_guard_harness.fuzz.runner import run_workload
from vllm_prefix_guard_harness.fuzz.shrink import (
    Budget,
    ddmin,
    reads_bad_kv,
    rolls_back_valid_kv,
    shrink,
)
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive

# The notes' deterministic layout, buried in unrelated traffic.
E2 = ZOMBIE_ARRIVALS
NOISE = (
    Arrive(0, "n0", ((5000, 8),), 1),
    Arrive(2, "n1", ((6000, 20),), 1),
    Abort(2, "n1"),
    Arrive(9, "n2", ((7000, 30),), 2),
    Arrive(40, "late", ((1, 160),), 2),
)


def test_ddmin_finds_a_one_minimal_subset() -> None:
    kept = ddmin(list(range(10)), lambda c: {3, 7} <= set(c), Budget(10))
    assert kept == [3, 7]


def test_shrinks_to_the_known_layout_and_only_stock_fails() -> None:
    workload = zombie_workload(*NOISE)
    small = shrink(workload, "stock", seconds=60)
    assert len(small.events) <= len(E2)
    assert not any(isinstance(e, Abort) for e in small.events)
    assert reads_bad_kv("stock")(small)
    assert run_workload(small, "guard").violations == 0
    namespace: dict[str, object] = {}
    exec(small.to_python(), namespace)
    assert namespace["WORKLOAD"] == small


@guard_only("the audit is the guard's rules")
def test_shrinks_a_precision_finding_that_reads_nothing_bad(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The audit's predicate shrinks a run that reads no bad KV (the preemption rule
    without its exception rolls back an entry a step in flight writes)."""
    every_preempted_entry_goes(monkeypatch)
    layout = PREEMPTED_WITH_ITS_BLOCK_WRITTEN_IN_FLIGHT
    holds = rolls_back_valid_kv()
    if not holds(layout):
        pytest.skip("this vLLM schedules the layout otherwise (shrunk on 0.32)")
    noisy = layout.replace([*layout.events, Arrive(30, "n0", ((9000, 20),), 1)])
    small = shrink(noisy, "guard", seconds=60, predicate=holds)
    assert run_workload(small, "guard").violations == 0
    assert holds(small)
    assert len(small.events) <= len(layout.events)
