"""The explorer on the CI scope: complete, the guard clean, stock exposed, hits equal
path by path; what it prints replays."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from vllm_prefix_guard import plugin
from vllm_prefix_guard_harness.explore.report import as_workload, reproducer
from vllm_prefix_guard_harness.explore.scope import CI_SCOPE, DEFAULT_SCOPES, SCOPES
from vllm_prefix_guard_harness.explore.search import SearchResult
from vllm_prefix_guard_harness.explore.system import (
    Events,
    Step,
    drain,
    replay,
)
from vllm_prefix_guard_harness.fuzz.runner import plugin_restored, run_workload
from vllm_prefix_guard_harness.shadow_kv import OUTPUT_OVER_BAD_KV

#: The session fixture of tests/harness/explore/conftest.py: (scope, modes) -> exploration.
Explore = Callable[[str, tuple[str, ...]], SearchResult]

BOTH = ("stock", "guard")


def test_ci_scope_explores_completely_in_under_two_minutes(explored: Explore) -> None:
    started = time.monotonic()
    result = explored(CI_SCOPE, BOTH)
    assert time.monotonic() - started < 120
    counters = result.counters
    assert result.complete and counters["unfinished"] == counters["errors"] == 0
    assert counters["states"] > 100 and counters["transitions"] >= counters["states"] - 1
    assert counters["complete_paths"] > 0
    # The zombie layout: stock reads a block that was never written; the guard never does.
    assert result.violations("stock") > 0
    assert result.violations("guard") == 0
    kinds = result.shortest("violation", "stock").detail["counts"]  # type: ignore[union-attr]
    assert kinds.get("never_written", 0) > 0


def test_guard_hits_equal_stock_on_every_clean_path(explored: Explore) -> None:
    result = explored(CI_SCOPE, BOTH)
    assert result.counters["compared_paths"] > 0
    assert result.of("hit_gap") == []


def test_stock_lane_beside_the_guard_is_stock_alone(explored: Explore) -> None:
    """The stock lane runs with the plugin applied (for the guarded lane beside it): its
    violations are those of a stock-only exploration."""
    paired = explored(CI_SCOPE, BOTH)
    alone = explored(CI_SCOPE, ("stock",))
    assert alone.complete
    assert {f.path for f in alone.of("violation")} == {
        f.path for f in paired.of("violation", "stock")
    }


def test_shortest_violation_replays_and_runs_as_a_workload(explored: Explore) -> None:
    """The reproducer printed for stock's shortest violation reads bad KV when replayed
    by the explorer and, as a fuzz workload, by the fuzz runner on its own."""
    scope = SCOPES[CI_SCOPE]
    finding = explored(CI_SCOPE, BOTH).shortest("violation", "stock")
    assert finding is not None
    with plugin_restored():
        system = drain(replay(scope, finding.path, ("stock", "guard")))
        assert system.lanes[0].bad_reads > 0 and system.lanes[1].bad_reads == 0
    workload = as_workload(scope, finding.path)
    assert workload is not None
    assert run_workload(workload, "stock").violations > 0
    assert run_workload(workload, "guard").violations == 0
    source = reproducer(scope, finding)
    namespace: dict[str, object] = {}
    with plugin_restored():
        exec(compile(source, "<reproducer>", "exec"), namespace)
    assert namespace["system"].lanes[0].bad_reads > 0  # type: ignore[attr-defined]
    assert not plugin.is_applied()


def test_steps_are_named_by_event() -> None:
    step = Step(Events((0, 1), "r0", True))
    assert Step.from_json(step.to_json()) == step
    assert step.describe() == "arrive r0, arrive r1, abort r0, reset"


def test_default_set_covers_sync_async_policies_and_failure_policies() -> None:
    scopes = [SCOPES[name] for name in DEFAULT_SCOPES]
    assert {s.async_scheduling for s in scopes} == {False, True}
    assert {s.policy for s in scopes} == {"fcfs", "priority"}
    assert {s.kv_load_failure_policy for s in scopes} >= {"fail", "recompute"}
    for scope in scopes:
        assert scope.name in scope.describe() and "horizon" in scope.describe()
    # A hybrid model with every state retained, and with an engine's default retention.
    assert {s.retention_interval for s in scopes if s.mamba_align} == {None, 0}


#: The explorer's finding on ``sync-fcfs-recompute`` (vLLM 0.32 and 0.33): r0 loads a
#: 3-block remote prefix and only the load of block 1 fails (policy recompute); r1, with
#: r0's prompt, arrives the next iteration. Stock reads nothing bad and r1 hits 12 tokens:
#: block 2 loaded fine, r0 rewrites block 1 in that step, and stock's entries then all
#: hold right KV. The guard removed r0's entries from its first failed block on, block
#: 2's included, so r1 hit 8; it now keeps the blocks that loaded fine, and r0 caches its
#: recomputed blocks around them. The fuzzer never failed part of a load, so it never saw
#: this.
RECOMPUTED_LOADER_PATH = (
    Step.from_json([[0], None, False, [["r0", 1]], False]),
    Step.from_json([[1], None, False, [], False]),
)


def test_guard_keeps_blocks_a_partial_failed_load_loaded_fine() -> None:
    scope = SCOPES["sync-fcfs-recompute"]
    with plugin_restored():
        system = drain(replay(scope, RECOMPUTED_LOADER_PATH, BOTH))
    stock, guard = system.lanes
    assert stock.bad_reads == guard.bad_reads == 0
    assert (stock.hit_tokens, guard.hit_tokens) == (12, 12)
    # r0 cached its recomputed blocks past the kept one: the pool checks no owner
    # on cache_full_blocks' hot path any more.
    assert guard.scheduler.kv_cache_manager.block_pool.kept_block_owners == set()


def test_kept_block_owner_lives_until_it_passes_its_kept_blocks() -> None:
    """The one step of ``RECOMPUTED_LOADER_PATH`` where r0's load fails: the rewind
    names r0 (it kept block 2 past its failed block 1), and r0 leaves once it caches
    past block 2; an owner freed before that leaves at the next rewind."""
    scope = SCOPES["sync-fcfs-recompute"]
    with plugin_restored():
        system = replay(scope, RECOMPUTED_LOADER_PATH[:1], BOTH)
        _, guard = system.lanes
        manager = guard.scheduler.kv_cache_manager
        owners = manager.block_pool.kept_block_owners
        assert owners == {("r0", 0)}
        owners.add(("freed", 0))
        manager.rewind_num_cached_blocks({})
        assert owners == {("r0", 0)}
        drain(system)
        assert owners == set()


#: A request preempted after its load failed starts over: r0's load fails on its block 1,
#: a reset preempts it while that step is in flight, and it resumes at once on its own
#: load's entries in the next step, dispatched before the failure's report (scope
#: ``async-reset-loader``, vLLM's deferred block free on). The oracle once kept counting
#: r0's reads after the restart as the failed load's known loss, so stock delivering the
#: token r0 computed over the failed blocks went unseen (and, with frees not deferred, the
#: KV r0 computed over a fresh load counted as bad).
RESTARTED_LOADER_PATH = (
    Step.from_json([[0], None, False, [["r0", 1]], False]),
    Step.from_json([[], None, True, [], False]),
)


def test_a_loader_restarted_after_its_failed_load_is_judged_afresh() -> None:
    scope = SCOPES["async-reset-loader"]
    with plugin_restored():
        system = drain(replay(scope, RESTARTED_LOADER_PATH, BOTH))
    stock, guard = system.lanes
    assert [(v.request_id, v.kind) for v in stock.driver.kv.violations] == [
        ("r0", OUTPUT_OVER_BAD_KV)
    ]
    assert guard.bad_reads == 0
    assert stock.drained and guard.drained


#: r1 (A, low priority) is preempted inside schedule() by r2 and resumed; r3 (A again)
#: arrives later. On vLLM 0.30 the guard's hits are 28 here, stock's 24, stock reading
#: nothing bad: the guard undid r1's never-written entries, freeing their blocks without a
#: hash, which the pool reuses first, while stock kept them cached and evicted a valid block
#: before them.
EVICTION_ORDER_PATH = (
    Step.from_json([[0, 1], None, False, [], False]),
    Step.from_json([[2], "r0", False, [], False]),
    Step.from_json([[], None, False, [], False]),
    Step.from_json([[3], "r2", False, [], False]),
)


def test_guard_hits_exceed_clean_stock_only_by_eviction_order() -> None:
    """The path comparison allows the guard more hits than clean stock only on a path
    where it undid entries (``System.guard_rolled_back``), never fewer."""
    with plugin_restored():
        system = drain(replay(SCOPES["hybrid-priority"], EVICTION_ORDER_PATH, BOTH))
    stock, guard = system.lanes
    assert stock.bad_reads == guard.bad_reads == 0
    assert guard.hit_tokens >= stock.hit_tokens
    assert system.guard_rolled_back()


#: The explorer's stock finding on ``hybrid-priority-sparse`` (vLLM 0.32), its shortest
#: path: with an engine's default retention a prompt leaves only its checkpoint's state
#: cached, and the priority-preemption zombie lands there: r1 and r3 (one 40-token prompt,
#: low priority) resume on a never-written entry of it (attention KV at 32-35, the state at
#: 36). With every state retained (``hybrid-priority``) no path reads bad state. On vLLM 0.30
#: and 0.31 this path schedules otherwise and reads nothing bad.
ZOMBIE_CHECKPOINT_PATH = (
    Step.from_json([[0, 1], None, False, [], False]),
    Step.from_json([[2, 3], "r0", False, [], False]),
    Step.from_json([[], "r2", False, [], False]),
    Step.from_json([[], "r1", False, [], False]),
)


def test_a_zombie_checkpoint_under_default_retention_is_read_by_stock_only() -> None:
    with plugin_restored():
        system = drain(replay(SCOPES["hybrid-priority-sparse"], ZOMBIE_CHECKPOINT_PATH, BOTH))
    stock, guard = system.lanes
    assert guard.bad_reads == 0
    if not stock.bad_reads:
        pytest.skip("the path reaches the window on vLLM 0.32 and 0.33's schedulers only")


#: Fields the digest cannot read, and why that is sound: the connector's configuration is
#: fixed when it is built, and a request's ``all_token_ids`` / ``output_token_ids`` are
#: read-only views of ``_all_token_ids`` / ``_output_token_ids``, digested by those names.
UNREAD_FIELDS = {
    ("FakeLoadConnector", "_kv_cache_config"),
    ("FakeLoadConnector", "_kv_cache_manager"),
    ("FakeLoadConnector", "_kv_transfer_config"),
    ("FakeLoadConnector", "_vllm_config"),
    ("Request", "all_token_ids"),
    ("Request", "output_token_ids"),
}


@pytest.mark.parametrize(
    "name", ["async-fcfs-recompute", "async-priority-fail", "sync-priority", "hybrid-async-retry"]
)
def test_digest_reads_every_field_that_can_change_what_happens_next(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field the digest cannot read would merge states that differ in it: it once
    merged async states whose deferred block frees (``Scheduler.deferred_frees``, lists
    of blocks) differed."""
    from vllm_prefix_guard_harness.explore import digest
    from vllm_prefix_guard_harness.explore.system import System

    unread: set[tuple[str, str]] = set()
    fields_of = digest.fields_of

    def recording(obj: object) -> tuple[object, ...]:
        out = fields_of(obj)
        for field, value in out:
            if isinstance(value, tuple) and value[:1] == ("unplain",):
                unread.add((type(obj).__name__, field))
        return out

    monkeypatch.setattr(digest, "fields_of", recording)
    with plugin_restored():
        system = System.build(SCOPES[name], BOTH)
        for _ in range(8):
            system.begin(system.event_options()[-1])
            system.finish(system.outcome_options()[0])
            system.digest()
    assert unread <= UNREAD_FIELDS
