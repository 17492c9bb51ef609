"""The capability probes measure vLLM, not the guard: where a probe finds this vLLM's own
machinery wrong, stock and guard read the same bad state there (nothing the guard could
fix, so the configurations relying on it are not run); where it finds it right, neither
reads anything bad."""

from __future__ import annotations

import pytest

from vllm_prefix_guard_harness.fuzz.capabilities import (
    ASYNC_LOAD_PROBE,
    PARTIAL_STATE_PROBES,
    async_loads_stall,
    failed_loads_unreported,
    partial_state_hits_unsound,
    scheduler_features_missing,
)
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.runner import run_workload


@pytest.mark.parametrize("probe", range(len(PARTIAL_STATE_PROBES)))
def test_partial_state_probe_reads_alike_with_and_without_the_guard(probe: int) -> None:
    workload = PARTIAL_STATE_PROBES[probe]
    stock, guard = (run_workload(workload, mode) for mode in ("stock", "guard"))
    assert (stock.bad_state_reads, stock.violations) == (guard.bad_state_reads, guard.violations)
    if partial_state_hits_unsound() is None:
        assert stock.violations == 0


def test_async_load_probe_stalls_alike_with_and_without_the_guard() -> None:
    stock, guard = (run_workload(ASYNC_LOAD_PROBE, mode) for mode in ("stock", "guard"))
    assert stock.stalled_runs == guard.stalled_runs == int(async_loads_stall() is not None)
    assert stock.violations == guard.violations == 0


def test_configurations_run_where_what_they_rely_on_is_sound() -> None:
    asynchronous = {c.name for c in CONFIGS.values() if c.loads_asynchronously}
    partial = {c.name for c in CONFIGS.values() if c.spec.mamba_block_multiple > 1}
    assert {"kv-load-async", "hybrid-kv-load-async"} <= asynchronous and partial
    for config in CONFIGS.values():
        reasons = [scheduler_features_missing(config.spec)]
        if config.name in asynchronous:
            if config.fails_kv_loads:
                reasons.append(failed_loads_unreported())
            reasons.append(async_loads_stall())
        if config.name in partial:
            reasons.append(partial_state_hits_unsound())
        assert config.unavailable() == next((r for r in reasons if r), None)
