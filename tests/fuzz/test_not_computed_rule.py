"""The not-computed rule (a request a step's output leaves out is rolled back) changes no
decision while the worker lists every request it was given, as vLLM's runners do: every
configuration's figures are identical with the rule switched off. (The configurations whose
worker drops aborted requests are the rule's own: ``tests/test_hybrid_state.py`` and the
fuzzer's checks. ``benchmarks/not_computed_rule.py`` runs this on more seeds.)"""

from __future__ import annotations

import dataclasses

import pytest

from native_fix import guard_only
from vllm_prefix_guard.diagnostics.fuzz.capabilities import scheduler_features_missing
from vllm_prefix_guard.diagnostics.fuzz.configs import CONFIGS
from vllm_prefix_guard.diagnostics.fuzz.runner import run_workload
from vllm_prefix_guard.scheduler_guard import SchedulerGuard

LISTING_EVERY_REQUEST = sorted(name for name, c in CONFIGS.items() if not c.drop_aborted)


@guard_only("it compares the guard with and without one of its rules")
@pytest.mark.parametrize("config", LISTING_EVERY_REQUEST)
def test_the_rule_changes_nothing_when_every_request_is_listed(
    config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = scheduler_features_missing(CONFIGS[config].spec)
    if missing is not None:  # a scheduler feature of a newer vLLM
        pytest.skip(missing)
    workload = CONFIGS[config].workload(seed=1, horizon=CONFIGS[config].horizon // 2)
    with_rule = run_workload(workload, "guard")
    monkeypatch.setattr(SchedulerGuard, "not_computed", lambda self, output, result: None)
    without = run_workload(workload, "guard")
    assert with_rule.steps > 0
    assert dataclasses.replace(with_rule, seconds=0) == dataclasses.replace(without, seconds=0)
