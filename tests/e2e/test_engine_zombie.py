"""Engine-level reproduction: a prefix-cache hit on KV that was never written.

The layout and the three engines are :mod:`guard_demo.engine_proof`'s (the main job opens its
report with the same proof): on a real in-process ``LLMEngine`` with the tiny Llama model, A is
preempted in the step that scheduled it, and C arrives with A's prompt. Stock vLLM hands C (and
the resumed A) A's never-written block; the guard rolls A's registrations back, and every
completion matches an engine without prefix caching. Measured on vLLM 0.32 (CPU, float32):
stock C and A differ from the reference from their first token on (top logprob off by 0.82
nat), the guard matches to within 1.2e-5.

Other platforms (``scripts/gpu_check.sh``) pass extra ``EngineArgs`` and a logprob tolerance
(:mod:`platform_args`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from platform_args import ATOL, EXTRA_ENGINE_ARGS

from guard_demo.engine_proof import LAYOUT, EngineProof, prove

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def proof(tiny_model: Path) -> EngineProof:
    """No prefix caching, stock and guarded, one engine each, in this process."""
    return prove(tiny_model, EXTRA_ENGINE_ARGS, ATOL)


def test_scenario_runs_as_laid_out(proof: EngineProof) -> None:
    """A is preempted in the third ``schedule()`` call (the one where it was scheduled first),
    in every engine; and the requested scheduling mode took effect."""
    for run in (proof.reference, proof.stock, proof.guarded):
        assert "A" in run.preempted[2], run.preempted[:4]
        assert run.async_scheduling == EXTRA_ENGINE_ARGS.get("async_scheduling", False)


def test_stock_prefix_caching_reads_unwritten_kv(proof: EngineProof) -> None:
    """Stock vLLM: C hits A's never-written block 9, and C and the resumed A diverge; B and
    D never touch A's blocks and match (proof that the tolerance is not what fails A and C)."""
    assert not proof.stock.guard_applied
    assert proof.stock.num_cached_tokens["C"] == 9 * LAYOUT.block_size
    assert proof.stock_diverges, proof.stock_divergences()


def test_guard_matches_reference(proof: EngineProof) -> None:
    """With the guard, C hits only A's written blocks, and every completion matches."""
    assert proof.guarded.guard_applied
    assert proof.guarded.num_cached_tokens["C"] == 8 * LAYOUT.block_size
    assert proof.guard_mismatches() == {}
    assert (proof.guarded.guard_counters or {})["rolled_back_preempted"] > 0


def test_the_demo_would_report_the_proof(proof: EngineProof) -> None:
    """What the main job's verdict checks is what the tests above check."""
    assert proof.failed_checks() == []
