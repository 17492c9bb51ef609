"""The verdicts of a differential run, on hand-made totals (no vLLM run needed)."""

from __future__ import annotations

import pytest

from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.differential import EXPLAINED, FAIL, OK, ConfigResult
from vllm_prefix_guard_harness.fuzz.runner import RunResult


def _drain(runs_by_mode: dict[str, tuple[int, int]]) -> tuple[str, str]:
    """'runs drain' for one seed where mode -> (requests released, requests left)."""
    result = ConfigResult(CONFIGS["everything-async"], ("stock", "guard"))
    runs = {mode: RunResult(mode, steps=10) for mode in result.modes}
    for mode, (released, left) in runs_by_mode.items():
        runs[mode].wedged_runs, runs[mode].released_requests = int(released > 0), released
        runs[mode].stalled_runs, runs[mode].stalled_requests = int(left > 0), left
    result.add(0, runs)
    (check,) = [c for c in result.checks() if c.name == "runs drain"]
    return check.status, check.detail


@pytest.mark.parametrize(
    ("runs_by_mode", "status"),
    [
        ({}, OK),
        # Wedged only by vLLM's dropped-output bug, and drained once those requests were
        # aborted: explained, on either side, even where stock missed it on this seed.
        ({"guard": (1, 0)}, EXPLAINED),
        ({"stock": (2, 0), "guard": (1, 0)}, EXPLAINED),
        # Anything left after that is a finding, whatever stock did.
        ({"stock": (1, 3), "guard": (1, 0)}, FAIL),
        ({"guard": (0, 1)}, FAIL),
    ],
)
def test_a_stall_is_explained_only_by_vllms_dropped_output_bug(
    runs_by_mode: dict[str, tuple[int, int]], status: str
) -> None:
    got, detail = _drain(runs_by_mode)
    assert got == status, detail


def test_violating_seeds_are_listed() -> None:
    result = ConfigResult(CONFIGS["victim"], ("stock", "guard"))
    for seed in range(10):
        runs = {mode: RunResult(mode, steps=10) for mode in result.modes}
        runs["stock"].wrong_content = seed % 2
        result.add(seed, runs)
    (check,) = [c for c in result.checks() if c.name == "stock reads bad KV"]
    assert check.status == OK
    assert check.detail == "5 bad reads in 5 of 10 seeds (seeds 1, 3, 5, 7, 9)"


def _preemptions(
    by_seed: list[tuple[int, int, bool]], exact: bool = True, rolled_back: int = 0
) -> tuple[str, str]:
    """'guard preemptions <= stock' over seeds of (stock's, guard's preemptions, whether
    stock read bad KV there), with an audit that is exact or not."""
    from vllm_prefix_guard_harness.fuzz.audit import AuditCounts

    result = ConfigResult(CONFIGS["hybrid-victim"], ("stock", "guard"))
    for seed, (stock_preempted, guard_preempted, stock_read_bad) in enumerate(by_seed):
        runs = {mode: RunResult(mode, steps=10) for mode in result.modes}
        runs["stock"].preemptions, runs["guard"].preemptions = stock_preempted, guard_preempted
        if stock_read_bad:
            runs["stock"].wrong_content, runs["stock"].first_violation_step = 1, 5
        runs["guard"].audit = AuditCounts()
        runs["guard"].rolled_back_preempted = rolled_back
        if not exact:
            runs["guard"].audit.add("preempted", "valid")
        result.add(seed, runs)
    (check,) = [c for c in result.checks() if c.name == "guard preemptions <= stock"]
    return check.status, check.detail


@pytest.mark.parametrize(
    ("by_seed", "exact", "rolled_back", "status"),
    [
        ([(5, 5, False), (7, 7, True)], True, 0, OK),
        # The excess lies only where stock read bad KV (a resumed request's wrong state
        # is no bad admission), every rollback needed: the runs part only there.
        ([(5, 5, False), (7, 9, True)], True, 0, EXPLAINED),
        # ... but not if a rollback was not needed,
        ([(5, 5, False), (7, 9, True)], False, 0, FAIL),
        # nor where stock read only valid KV, unless the guard's needed rollbacks changed
        # the eviction order there (hybrid-victim on vLLM 0.33: +176 and +68).
        ([(5, 6, False), (7, 9, True)], True, 0, FAIL),
        ([(5, 6, False), (7, 9, True)], True, 3, EXPLAINED),
        ([(5, 6, False), (7, 9, True)], False, 3, FAIL),
    ],
)
def test_extra_preemptions_are_explained_seed_by_seed(
    by_seed: list[tuple[int, int, bool]], exact: bool, rolled_back: int, status: str
) -> None:
    got, detail = _preemptions(by_seed, exact, rolled_back)
    assert got == status, detail
