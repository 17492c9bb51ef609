"""Diagnostics observe, never decide: the rollback audit changes nothing the guard does.

The audit (:class:`~vllm_prefix_guard_harness.fuzz.audit.RollbackAudit`) runs the
guard's rules as a subclass that only looks. Installed, it must leave every counter of a
guarded run and its trajectory (every step's decisions) exactly as the plain guard's, in
every fuzz configuration. The production guard has no hook a diagnostic could assign:
the rules object is built by the scheduler hook and replaced only whole, before a step.
"""

from __future__ import annotations

import dataclasses

import pytest

from native_fix import guard_only
from vllm_prefix_guard_harness.fuzz.capabilities import scheduler_features_missing
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.runner import run_workload

#: What a run decided: if the audit changed a decision, one of these differs.
DECISIONS = (
    "steps",
    "hit_tokens",
    "computed_tokens",
    "loaded_tokens",
    "preemptions",
    "rolled_back_preempted",
    "rolled_back_kv_load_failure",
    "rolled_back_dropped_step",
    "dependents_preempted",
    "peak_uncommitted_entries",
    "never_written",
    "wrong_content",
    "decisions",
)


@guard_only("it compares the guard with and without its audit")
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_installing_the_audit_changes_no_decision(config: str) -> None:
    # Half the CI horizon: every targeted configuration still rolls back (checked below).
    missing = scheduler_features_missing(CONFIGS[config].spec)
    if missing is not None:  # a scheduler feature of a newer vLLM
        pytest.skip(missing)
    workload = CONFIGS[config].workload(seed=1, horizon=CONFIGS[config].horizon // 2)
    plain = run_workload(workload, "guard")
    audited = run_workload(workload, "guard", audit=True)
    assert plain.audit is None and audited.audit is not None
    plain_figures = {name: getattr(plain, name) for name in DECISIONS}
    audited_figures = {name: getattr(audited, name) for name in DECISIONS}
    assert audited_figures == plain_figures
    if CONFIGS[config].targeted and CONFIGS[config].unavailable() is None:
        rolled_back = ("rolled_back_preempted", "rolled_back_kv_load_failure")
        assert sum(plain_figures[name] for name in rolled_back) > 0, "nothing to observe"
    assert plain.steps > 0 and dataclasses.replace(audited, audit=None, seconds=0) == (
        dataclasses.replace(plain, seconds=0)
    )
