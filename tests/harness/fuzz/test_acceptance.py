"""The fuzz acceptance checks on the CI differential run (see ``conftest.py``).

One test per check and configuration, so a failure names both. The checks themselves
live in ``differential`` (the CLI and the soak apply the same ones); here they must not
FAIL, and where stock read only valid KV they must pass outright (not "explained").
"""

from __future__ import annotations

import pytest

from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.differential import (
    DECISIONS_CHECK,
    EXPLAINED,
    FAIL,
    HITS_CHECK,
    KV_EVENTS_CHECK,
    OK,
    ConfigResult,
)

TARGETED = [name for name, config in CONFIGS.items() if config.targeted]
ALL = list(CONFIGS)
ASYNC = [name for name, config in CONFIGS.items() if config.depth > 1]


def _check(result: ConfigResult, name: str) -> tuple[str, str]:
    [check] = [c for c in result.checks() if c.name == name]
    return check.status, check.detail


@pytest.mark.parametrize("config", ALL)
def test_guard_reads_no_bad_kv(ci_results: dict[str, ConfigResult], config: str) -> None:
    result = ci_results[config]
    guard = result.totals["guard"]
    assert guard.violations == 0, (result.violating_seeds["guard"], guard.examples[:5])


@pytest.mark.parametrize("config", ALL)
def test_guard_kv_events_match_its_prefix_cache(
    ci_results: dict[str, ConfigResult], config: str
) -> None:
    """Both consumer models replayed from the guard's KV events equal the pool's keys after
    every step: a set (``BlockStored`` adds, ``BlockRemoved`` removes) and a count per key
    (Dynamo's ``EventDedupFilter``). Stock's inconsistencies are its exposure, stated in
    the check's detail."""
    result = ci_results[config]
    guard = result.totals["guard"]
    detail = _check(result, KV_EVENTS_CHECK)[1]
    assert guard.kv_event_keys_missing == guard.kv_event_keys_extra == 0, detail
    assert guard.kv_event_counted_keys_missing == guard.kv_event_counted_keys_extra == 0, detail


def test_stock_kv_events_disagree_with_its_cache_somewhere(
    ci_results: dict[str, ConfigResult],
) -> None:
    """The event check has teeth: stock vLLM announces cached keys as removed (an evicted
    copy of a key another block still caches) in the CI runs."""
    assert sum(r.totals["stock"].kv_event_keys_missing for r in ci_results.values()) > 0


@pytest.mark.parametrize("config", TARGETED)
def test_stock_reads_bad_kv_in_targeted_configs(
    ci_results: dict[str, ConfigResult], config: str
) -> None:
    assert ci_results[config].totals["stock"].violations > 0


@pytest.mark.parametrize("config", ALL)
def test_guard_decides_as_stock_until_stock_reads_bad_kv(
    ci_results: dict[str, ConfigResult], config: str
) -> None:
    """On every seed where stock read only valid KV, the guard's run is stock's, step for
    step (every admission, hit, chunk and preemption): it costs nothing where there is
    nothing to fix. Where stock read bad KV the runs part there, and the totals compare
    under the hits and preemptions checks (the difference is then divergence, audited:
    no valid entry undone; e.g. everything-async on vLLM 0.32, seeds 0-2: guard 164768
    hit tokens, stock 165312 on valid KV, and per seed the sign varies)."""
    result = ci_results[config]
    status, detail = _check(result, DECISIONS_CHECK)
    if CONFIGS[config].spec.mamba_align:
        # The guard's rolled-back blocks are reused first (no hash), stock's kept as cached:
        # eviction order parts the runs, and vLLM ends hybrid prefill chunks at the
        # longest single-group hit, so it shows in decisions (explained: audit exact).
        assert status in (OK, EXPLAINED), detail
    else:
        assert status == OK, detail
    assert result.clean_seeds + len(result.violating_seeds["stock"]) == len(result.seeds)


@pytest.mark.parametrize("check", [HITS_CHECK, "guard preemptions <= stock"])
@pytest.mark.parametrize("config", ALL)
def test_guard_costs_no_hits_or_preemptions(
    ci_results: dict[str, ConfigResult], config: str, check: str
) -> None:
    result = ci_results[config]
    status, detail = _check(result, check)
    assert status != FAIL, detail
    if CONFIGS[config].spec.mamba_align:
        # As in the decisions check: eviction order, explained only with an exact audit.
        assert status in (OK, EXPLAINED), detail
    elif result.totals["stock"].bad_admissions == 0:
        # Stock read only valid KV: guard and stock must decide alike.
        assert status == OK, detail
    else:
        assert status in (OK, EXPLAINED), detail


@pytest.mark.parametrize("check", ["guard rolls back only bad KV", "guard commits only valid KV"])
@pytest.mark.parametrize("config", ALL)
def test_guard_rollbacks_are_exact(
    ci_results: dict[str, ConfigResult], config: str, check: str
) -> None:
    """The rollback audit (shadow KV): every entry the guard undid held, or would hold
    once the dispatched steps ran, KV other than its key names, every reader it preempted
    counted such KV as computed, and no entry it committed held wrong KV."""
    status, detail = _check(ci_results[config], check)
    assert status == OK, detail


@pytest.mark.parametrize("config", ALL)
def test_runs_drain_or_stall_only_on_vllms_dropped_output_bug(
    ci_results: dict[str, ConfigResult], config: str
) -> None:
    status, detail = _check(ci_results[config], "runs drain")
    assert status != FAIL, detail


@pytest.mark.parametrize("config", (ALL))
def test_pr43569_is_measured_and_clean(ci_results: dict[str, ConfigResult], config: str) -> None:
    result = ci_results[config]
    pr = result.totals["pr43569"]
    assert pr.steps > 0
    assert pr.violations == 0, pr.examples[:5]
    if CONFIGS[config].depth == 1:
        # Nothing is in flight when schedule() runs: the two scopes coincide.
        assert pr.rolled_back_in_flight == 0
        assert pr.computed_tokens == result.totals["guard"].computed_tokens


def test_pr43569_over_evicts_under_async_scheduling(ci_results: dict[str, ConfigResult]) -> None:
    """The wider scope throws away entries of steps that will run: more work, more
    preemptions than the guard, summed over the async configurations."""
    guard = sum(ci_results[c].totals["guard"].preemptions for c in ASYNC)
    pr = sum(ci_results[c].totals["pr43569"].preemptions for c in ASYNC)
    in_flight = sum(ci_results[c].totals["pr43569"].rolled_back_in_flight for c in ASYNC)
    assert in_flight > 0
    assert pr > guard
