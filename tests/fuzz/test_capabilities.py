"""The capability probes measure vLLM, not the guard: where a probe finds this vLLM's own
machinery wrong, stock and guard read the same bad state there (nothing the guard could
fix, so the configurations relying on it are not run); where it finds it right, neither
reads anything bad."""

from __future__ import annotations

import pytest

from vllm_prefix_guard.diagnostics.fuzz.capabilities import (
    PARTIAL_STATE_PROBES,
    partial_state_hits_unsound,
)
from vllm_prefix_guard.diagnostics.fuzz.configs import CONFIGS
from vllm_prefix_guard.diagnostics.fuzz.runner import run_workload


@pytest.mark.parametrize("probe", range(len(PARTIAL_STATE_PROBES)))
def test_partial_state_probe_reads_alike_with_and_without_the_guard(probe: int) -> None:
    workload = PARTIAL_STATE_PROBES[probe]
    stock, guard = (run_workload(workload, mode) for mode in ("stock", "guard"))
    assert (stock.bad_state_reads, stock.violations) == (guard.bad_state_reads, guard.violations)
    if partial_state_hits_unsound() is None:
        assert stock.violations == 0


def test_partial_configurations_run_where_partial_state_hits_are_sound() -> None:
    partial = [c for c in CONFIGS.values() if c.spec.mamba_block_multiple > 1]
    assert partial, "no configuration makes partial state hits"
    reason = partial_state_hits_unsound()
    assert all(c.unavailable() == reason for c in partial)
    assert all(c.unavailable() is None for c in CONFIGS.values() if c not in partial)
