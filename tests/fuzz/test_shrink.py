"""The shrinker turns a failing run into a few-line reproducer that still fails."""

from __future__ import annotations

from vllm_prefix_guard.diagnostics.factory import SchedulerSpec
from vllm_prefix_guard.diagnostics.fuzz.runner import run_workload
from vllm_prefix_guard.diagnostics.fuzz.shrink import Budget, ddmin, reads_bad_kv, shrink
from vllm_prefix_guard.diagnostics.fuzz.workload import Abort, Arrive, Workload

# The notes' deterministic layout (README, "Findings"), buried in unrelated traffic.
E2 = (
    Arrive(0, "D", ((1000, 16),), 3),
    Arrive(0, "A", ((1, 160),), 4, priority=1),
    Arrive(1, "B", ((2000, 120),), 4),
    Arrive(3, "C", ((1, 160),), 4, priority=1),
)
NOISE = (
    Arrive(0, "n0", ((5000, 8),), 1),
    Arrive(2, "n1", ((6000, 20),), 1),
    Abort(2, "n1"),
    Arrive(9, "n2", ((7000, 30),), 2),
    Arrive(40, "late", ((1, 160),), 2),
)
SPEC = SchedulerSpec(num_blocks=20, policy="priority", long_prefill_token_threshold=64)


def test_ddmin_finds_a_one_minimal_subset() -> None:
    kept = ddmin(list(range(10)), lambda c: {3, 7} <= set(c), Budget(10))
    assert kept == [3, 7]


def test_shrinks_to_the_known_layout_and_only_stock_fails() -> None:
    workload = Workload(SPEC, 1, E2 + NOISE)
    small = shrink(workload, "stock", seconds=60)
    assert len(small.events) <= len(E2)
    assert not any(isinstance(e, Abort) for e in small.events)
    assert reads_bad_kv("stock")(small)
    assert run_workload(small, "guard").violations == 0
    namespace: dict[str, object] = {}
    exec(small.to_python(), namespace)
    assert namespace["WORKLOAD"] == small
