"""Seeds the soak (``nox -s soak-*``) found failing, replayed at the soak's horizon.

``everything-async`` seed 17 (vLLM 0.32, found 2026-12-01): a request loads blocks
(sync, valid) in step N while a failed load of step N-1 is reported on a block id it was
given since; vLLM blames it by block id and rewinds it below its loaded blocks, and a
later failed load it had hit makes it a reader of bad KV. It then recomputes, over bad
KV, a block whose entry the guard had kept as loaded: the entry stayed hashed on
poisoned KV and the request read it on resuming (1267 bad reads). Found while the
fuzzer's ``AsyncScheduler`` freed blocks of a step in flight at once; vLLM defers those
frees wherever a KV load can fail (``defer_block_free``), which closes the window, so the
rule added for it went (issue 42). The seed stays: the guard must read nothing bad there.
"""

from __future__ import annotations

import functools

import pytest

from native_fix import INSTALLED as NATIVE_FIX_INSTALLED
from native_fix import guard_only
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.runner import RunResult, run_workload

#: (configuration, seed): what the soak found; the soak's horizon is 5x the CI one.
#: ``hybrid-retry-async`` seed 9 (vLLM 0.33, found 2026-12-03): the audit counted a
#: preempted request's state entry as valid KV rolled back; the block held the right state
#: only because its earlier tenant had left it there (state blocks are not zeroed), which
#: the audit now tells apart (leftover), as it does for attention KV.
#: ``everything-async`` seed 2 (vLLM 0.32, found 2026-12-05): a loader preempted by a reset
#: before its failed load's report resumed at once on its own load's entries, and the token
#: that step sampled over them was delivered (``test_kv_load_failure.py``).
FOUND_BY_SOAK = [("everything-async", 17), ("hybrid-retry-async", 9), ("everything-async", 2)]
SOAK_HORIZON_FACTOR = 5


@functools.cache
def soak_horizon_run(name: str, seed: int) -> RunResult:
    """One guarded run at the soak's horizon, shared by the two tests below: the audit
    observes and never decides (``test_diagnostics_observe.py``), so it is on wherever
    the guard's rules run (not on a vLLM with its own fix)."""
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()
    config = CONFIGS[name]
    workload = config.workload(seed, config.horizon * SOAK_HORIZON_FACTOR)
    return run_workload(workload, "guard", audit=not NATIVE_FIX_INSTALLED)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "seed"), FOUND_BY_SOAK)
def test_soak_finding_stays_fixed(name: str, seed: int) -> None:
    """The oracle's verdict (on a vLLM with its own fix, the fix's)."""
    guard = soak_horizon_run(name, seed)
    assert guard.violations == 0, guard.examples[:5]


@pytest.mark.slow
@guard_only("the rollback audit judges the guard's rules")
@pytest.mark.parametrize(("name", "seed"), FOUND_BY_SOAK)
def test_soak_finding_audit_is_clean(name: str, seed: int) -> None:
    guard = soak_horizon_run(name, seed)
    assert guard.audit is not None
    assert guard.audit.invalid_committed == 0, guard.audit.examples
    assert guard.audit.valid_rolled_back == 0, guard.audit.examples


@pytest.mark.slow
def test_a_backlog_draining_is_no_stall() -> None:
    """``hybrid-retry-async`` seed 4 (vLLM 0.33, found 2026-12-03): the soak counted a
    stalled run in stock and the guard alike; it was a backlog of 2,006 requests at the
    last arrival, still draining (a request finishing at least every 25 iterations) when
    the fixed drain budget ran out. The budget now restarts whenever a request finishes."""
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()
    config = CONFIGS["hybrid-retry-async"]
    workload = config.workload(4, config.horizon * SOAK_HORIZON_FACTOR)
    run = run_workload(workload, "stock")
    assert run.stalled_runs == 0
