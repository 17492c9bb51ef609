"""Teeth: with one rule taken out, the explorer finds the violation the rule prevents,
on a small scope; the guard itself finds none there."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm_prefix_guard_harness.explore.mutations import MUTATION_SCOPES
from vllm_prefix_guard_harness.explore.search import SearchResult
from vllm_prefix_guard_harness.shadow_kv import STATE_NEVER_WRITTEN

#: The session fixture of tests/harness/explore/conftest.py: (scope, modes) -> exploration.
Explore = Callable[[str, tuple[str, ...]], SearchResult]

CAUGHT = (
    "stock",
    "no-reader-rollback",
    "no-dropped-step-rollback",
    "no-readmitted-reader",
)


@pytest.mark.parametrize("mutation", CAUGHT)
def test_mutation_is_caught(explored: Explore, mutation: str) -> None:
    scope = MUTATION_SCOPES[mutation]
    mutant = explored(scope, (mutation,))
    assert mutant.complete
    assert mutant.violations(mutation) > 0
    guard = explored(scope, ("guard",))
    assert guard.complete and guard.violations("guard") == 0


def test_dropped_step_rollback_covers_state_blocks(explored: Explore) -> None:
    """On a hybrid model the dropped step's never-written state entries are read too:
    stock and the guard without its dropped-step rule resume from a state block no step
    wrote; the guard reads none."""
    for lane in ("stock", "no-dropped-step-rollback"):
        result = explored("hybrid-async-drop", (lane,))
        assert result.complete
        kinds = {kind for f in result.of("violation", lane) for kind in f.detail["counts"]}
        assert STATE_NEVER_WRITTEN in kinds, kinds
    guard = explored("hybrid-async-drop", ("guard",))
    assert guard.complete and guard.violations("guard") == 0
