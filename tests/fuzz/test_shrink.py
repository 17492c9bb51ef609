"""The shrinker turns a failing run into a few-line reproducer that still fails."""

from __future__ import annotations

from layouts import ZOMBIE_ARRIVALS, zombie_workload
from vllm_prefix_guard.diagnostics.fuzz.runner import run_workload
from vllm_prefix_guard.diagnostics.fuzz.shrink import Budget, ddmin, reads_bad_kv, shrink
from vllm_prefix_guard.diagnostics.fuzz.workload import Abort, Arrive

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
