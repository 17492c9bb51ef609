"""Teeth: with one rule taken out, the explorer finds the violation the rule prevents,
on a small scope; the guard itself finds none there."""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Callable

import pytest

from vllm_prefix_guard.diagnostics.explore.mutations import MUTATION_SCOPES, KeptEntriesStay
from vllm_prefix_guard.diagnostics.explore.search import SearchResult
from vllm_prefix_guard.diagnostics.shadow_kv import STATE_NEVER_WRITTEN
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads

#: The session fixture of tests/explore/conftest.py: (scope, modes) -> exploration.
Explore = Callable[[str, tuple[str, ...]], SearchResult]

CAUGHT = (
    "stock",
    "no-reader-rollback",
    "no-dropped-step-rollback",
    "no-recomputed-kept-rollback",
    "no-readmitted-reader",
)
#: The only scope with vLLM's deferred block free off.
CAUGHT_UNFENCED = "async-priority-unfenced"


@pytest.mark.parametrize("mutation", CAUGHT)
def test_mutation_is_caught(explored: Explore, mutation: str) -> None:
    scope = MUTATION_SCOPES[mutation]
    mutant = explored(scope, (mutation,))
    assert mutant.complete
    assert mutant.violations(mutation) > 0
    guard = explored(scope, ("guard",))
    assert guard.complete and guard.violations("guard") == 0


def test_seed_17_scope_is_the_only_one_with_frees_not_deferred() -> None:
    """The seed-17 window needs blocks of a step in flight freed at once and given to
    another loader, which vLLM then blames by block id for the failed load: vLLM's
    deferred block free closes it wherever a KV consumer runs with steps in flight, so
    the mutation is caught (``test_mutation_is_caught``) on the one scope that switches
    the fence off, where the guard reads no bad KV either."""
    from vllm_prefix_guard.diagnostics.explore.scope import SCOPES

    assert SCOPES[MUTATION_SCOPES["no-recomputed-kept-rollback"]].unfenced_frees
    assert not any(s.unfenced_frees for name, s in SCOPES.items() if name != CAUGHT_UNFENCED)


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


def _body(function: object) -> list[str]:
    source = textwrap.dedent(inspect.getsource(function))  # type: ignore[arg-type]
    lines = [line.split("#")[0].rstrip() for line in source.splitlines()]
    start = next(i for i, line in enumerate(lines) if line.endswith(":") and "->" in line)
    return [line for line in lines[start + 1 :] if line.strip() and '"""' not in line]


def test_seed_17_mutation_is_the_original_walk_minus_its_rule() -> None:
    """``KeptEntriesStay.walk`` is ``FailedKVLoads.walk`` with exactly the block that
    undoes a reader's kept entries recomputed by a later step removed."""
    original = [line for line in _body(FailedKVLoads.walk) if not line.strip().startswith(("#",))]
    mutated = _body(KeptEntriesStay.walk)
    removed = [line for line in original if line not in mutated]
    assert any("first_computed_tokens" in line for line in removed)
    assert any("_remove_computed_from" in line for line in removed)
    assert [line for line in original if line in mutated] == mutated
