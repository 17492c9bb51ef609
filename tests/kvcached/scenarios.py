"""Every kvcached scenario of one load order, in one interpreter; prints ``RESULT {json}``.

kvcached patches vLLM process-wide with no undo, so each load order needs a fresh
interpreter; within it, every scenario of that order runs (the tests assert on the JSON).

Usage (repository root on ``PYTHONPATH`` as ``src``, this directory too)::

    KVCACHED_SRC=.nox/kvcached-0.1.6 python -m scenarios ORDER

Orders:
    guard_first     ``plugin.apply()``, then kvcached's autopatch (imported by hand); the
                    guarded runs, then the guard undone and the same runs on kvcached alone
    kvcached_first  the order of a kvcached install: its ``kvcached_autopatch.pth`` ran at
                    interpreter start (the harness starts this one so) and kvcached patches
                    during ``import vllm``; ``doctor``, the runs on kvcached alone, then
                    ``plugin.apply()`` and the guarded runs
    vllm_pool       started the same way, on a vLLM where kvcached builds its legacy pool
                    (>= 0.31): ``doctor``; with ``ENABLE_KVCACHED`` unset the guard on vLLM's
                    own pool; enabled, the refusals
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import kvcached_cpu

import layouts

# -- what a run reports ---------------------------------------------------------------


class Audit:
    """Counts what reaches the pool's hash index (``BlockHashToBlockMap.insert``, the one
    place vLLM's ``_insert_block_hash`` and so kvcached's native-index pool add an entry)
    while the guard records a step, and what its pool recorded, pair by pair."""

    current: Audit | None = None

    def __init__(self, scheduler: Any) -> None:
        from vllm_prefix_guard.hooks import guard_of

        guarded = guard_of(scheduler) is not None
        self.inserted_open: list[tuple[Any, int]] = []
        self.inserted_outside_steps = 0
        self.recorded: list[tuple[Any, int]] = []
        pool = scheduler.kv_cache_manager.block_pool
        self.pool = pool
        index = pool.cached_block_hash_to_block
        insert = index.insert

        def audited_insert(key: Any, block: Any) -> None:
            # A step's record is open on the pool (set by the guard's rules).
            if guarded and pool.uncommitted_entries is not None:
                self.inserted_open.append((key, block.block_id))
            else:
                self.inserted_outside_steps += 1
            insert(key, block)

        index.insert = audited_insert
        Audit.current = self

    @staticmethod
    def install_recorder() -> None:
        """Wrap the factories of the guard's registering wrappers (so that every later
        ``plugin.apply()`` installs recording ones): what a call added to the open step's
        record for its request (a move: for none) is what the guard recorded."""
        from vllm_prefix_guard import pool as guard_pool

        def recording_factory(
            wrap: Any, request_of: Callable[[tuple[Any, ...], dict[str, Any]], Any]
        ) -> Any:
            def recording_wrap(original: Any) -> Any:
                wrapper = wrap(original)

                def recording(pool: Any, *args: Any, **kwargs: Any) -> Any:
                    entries = pool.uncommitted_entries
                    request_id = request_of(args, kwargs)
                    known = len(entries.get(request_id, ())) if entries is not None else 0
                    result = wrapper(pool, *args, **kwargs)
                    audit = Audit.current
                    if audit is not None and entries is not None:
                        new = entries.get(request_id, [])[known:]
                        audit.recorded.extend((key, block.block_id) for key, block, _ in new)
                    return result

                return recording

            return recording_wrap

        def by_request(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            # vLLM calls both by keyword (single_type_kv_cache_manager), tests by position.
            return (kwargs["request"] if "request" in kwargs else args[0]).request_id

        for name, request_of in (
            ("wrap_cache_full_blocks", by_request),
            ("wrap_cache_partial_block", by_request),
            ("wrap_move_block_hashes", lambda args, kwargs: None),
        ):
            setattr(guard_pool, name, recording_factory(getattr(guard_pool, name), request_of))

    def report(self) -> dict[str, Any]:
        pairs = list(zip(self.inserted_open, self.recorded, strict=False))
        same = len(self.inserted_open) == len(self.recorded) and all(
            ik is rk and ib == rb for (ik, ib), (rk, rb) in pairs
        )
        return {
            "inserted_while_step_open": len(self.inserted_open),
            "recorded_by_guard": len(self.recorded),
            "each_recorded": same,
            "inserted_outside_steps": self.inserted_outside_steps,
            # kvcached's legacy index: stays empty when nothing bypasses vLLM's.
            "kvcached_legacy_index_entries": len(getattr(self.pool, "_cached_blocks", {})),
        }


@contextlib.contextmanager
def audited() -> Iterator[None]:
    """Every scheduler the factory builds meanwhile is audited (:class:`Audit`)."""
    from vllm_prefix_guard_harness import factory

    factory.ON_BUILT.append(Audit)
    try:
        yield
    finally:
        factory.ON_BUILT.remove(Audit)


def pool_info(scheduler: Any) -> dict[str, Any]:
    from vllm.v1.core import block_pool as bp

    from vllm_prefix_guard.hooks import guard_of
    from vllm_prefix_guard.patching import is_guard_patch

    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    elastic = getattr(bp, "ElasticBlockPool", None)
    return {
        "scheduler": type(scheduler).__name__,
        "pool_mro": [c.__name__ for c in type(pool).__mro__],
        "is_elastic": elastic is not None and isinstance(pool, elastic),
        "native_mixin": kvcached_cpu.native_mixin(type(pool)),
        # Its registrations reach the guard's wrappers on vLLM's BlockPool, and a
        # guard attached to it.
        "guarded": is_guard_patch(vars(bp.BlockPool)["cache_full_blocks"]) and pool.guard_attached,
        "has_guard": guard_of(scheduler) is not None,
        "shared": pool is manager.coordinator.block_pool
        and all(m.block_pool is pool for m in manager.coordinator.single_type_managers),
        "evict_releases": type(pool).evict_blocks is not bp.BlockPool.evict_blocks,
    }


def verdict(driver: Any) -> dict[str, Any]:
    """What the shadow-KV worker saw, what vLLM reported, what the guard did."""
    from vllm_prefix_guard.hooks import guard_of

    guard = guard_of(driver.scheduler)
    audit = Audit.current
    out: dict[str, Any] = {
        "violations": driver.violations,
        "counts": dict(driver.kv.counts),
        "readers": sorted({v.request_id for v in driver.kv.violations}),
        "hit_tokens": driver.hit_tokens,
        "query_tokens": driver.query_tokens,
        "preemptions": driver.preemptions,
        "steps": len(driver.outputs),
        "pool": pool_info(driver.scheduler),
        "stats": guard.counters() if guard else None,
        "idle": guard.is_idle if guard else None,
    }
    if guard is not None and audit is not None:
        out["audit"] = audit.report()
    return out


# -- the runs: the same on kvcached alone and guarded ---------------------------------
# The layouts of the regression tests on vLLM's pool (tests/layouts.py), here on kvcached's.


def zombie(async_scheduling: bool) -> Any:
    """The shared notes' priority-preemption layout (``vllm_prefix_guard_harness.notes_zombie``)."""
    from vllm_prefix_guard_harness import notes_zombie

    return notes_zombie.zombie_layout(async_scheduling=async_scheduling)


RUNS: dict[str, Callable[[], Any]] = {
    "zombie_sync": lambda: zombie(False),
    "zombie_async": lambda: zombie(True),
    "kv_load_sync_recompute": lambda: layouts.failed_sync_load("recompute", False),
    "kv_load_sync_fail_aborted": lambda: layouts.failed_sync_load("fail", True),
    "kv_load_async": lambda: layouts.failed_load_two_in_flight()[0],
    "fcfs_sync": layouts.fcfs_preemption,
    "fcfs_async": layouts.fcfs_preemption_two_in_flight,
}


def audited_verdict(run: Callable[[], Any]) -> dict[str, Any]:
    """``run``'s verdict, its scheduler audited (:class:`Audit`) when guarded."""
    try:
        with audited():
            return verdict(run())
    finally:
        Audit.current = None


def kv_event_shapes() -> dict[str, Any]:
    """The two KV-event shapes of ``tests/regression/test_kv_events.py`` on this process's pool."""
    out: dict[str, Any] = {}
    for name, shape in (
        ("eviction", layouts.kv_events_eviction_shape),
        ("rollback", layouts.kv_events_rollback_shape),
    ):
        try:
            out[name] = shape()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "where": _where()}
    return out


def run_all() -> dict[str, Any]:
    out = {}
    for name, run in RUNS.items():
        started = time.perf_counter()
        try:
            out[name] = audited_verdict(run)
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "where": _where()}
        out[name]["seconds"] = round(time.perf_counter() - started, 2)
    return out


# -- pool-level scenarios on kvcached's pool (guarded) ------------------------------------


def _guarded_pool() -> tuple[Any, Any, Any, Any]:
    from vllm_prefix_guard.hooks import guard_of
    from vllm_prefix_guard_harness import factory

    scheduler = factory.make_scheduler(num_blocks=16)
    guard = guard_of(scheduler)
    assert guard is not None
    return scheduler, guard, guard.pool, kvcached_cpu.ALLOCATORS[-1]


def _step(guard: Any, pool: Any, request: Any, blocks: list[Any]) -> object:
    """One scheduler step's registrations of ``blocks`` for ``request``, dispatched."""
    guard.begin_step()
    pool.cache_full_blocks(request, blocks, 0, len(blocks), 16, 0)
    output = object()
    guard.end_step(output)
    return output


def _empty_step_committed(guard: Any) -> None:
    """A later step comes back first: every older step still in flight is dropped."""
    guard.begin_step()
    output = object()
    guard.end_step(output)
    guard.commit_step(output)


def duplicates() -> dict[str, Any]:
    """kvcached #401 shape: one key in several physical blocks; rolling one back keeps
    the siblings hashed and hittable (live block: rolled back on preemption; freed block
    of a dropped step: evicted through kvcached's ``evict_blocks``)."""
    from vllm.v1.core.kv_cache_utils import get_block_hash

    from vllm_prefix_guard.hooks import guard_of
    from vllm_prefix_guard_harness.factory import make_request, make_scheduler
    from vllm_prefix_guard_harness.shadow_kv import Driver

    scheduler = make_scheduler(num_blocks=40)
    driver = Driver(scheduler)
    for name in ("x", "y"):  # greedy-identical: their decode block is one key twice
        driver.add(make_request(name, list(range(1, 17)), max_tokens=24))
    driver.run()
    pool = scheduler.kv_cache_manager.block_pool
    guard = guard_of(scheduler)
    assert guard is not None
    allocator = kvcached_cpu.ALLOCATORS[-1]
    key, siblings_map = next(
        (k, v) for k, v in pool.cached_block_hash_to_block._cache.items() if isinstance(v, dict)
    )
    siblings = list(siblings_map.values())
    tokens = driver.worker.models["x"].tokens[:32]

    def siblings_ok() -> dict[str, Any]:
        hit = pool.get_cached_block(get_block_hash(key), [0])
        return {
            "hashed": [b.block_hash == key for b in siblings],
            "kvcached_owns": [b.block_id in pool._block_id_to_key for b in siblings],
            "hit_is_sibling": bool(hit) and hit[0] in siblings,
        }

    out: dict[str, Any] = {"siblings": len(siblings), "violations": driver.violations}
    # 1. A live copy (ref_cnt 1) registered in the open step, rolled back on preemption.
    z = make_request("z", tokens)
    guard.begin_step()
    fresh = pool.get_new_blocks(2)
    pool.cache_full_blocks(z, fresh, 0, 2, 16, 0)
    out["live_copy_under_key"] = key in {b.block_hash for b in fresh}
    guard.preempted(z)  # nothing computed: every entry of its step goes
    guard.end_step(object())  # the step is dispatched without it
    out["live"] = {
        "copy_unhashed": [b.block_hash is None for b in fresh],
        "copy_not_owned": [b.block_id not in pool._block_id_to_key for b in fresh],
        **siblings_ok(),
    }
    freed_before = allocator.freed_total
    pool.free_blocks(fresh)  # no hash left: kvcached returns them at once
    out["live"]["copy_freed_physically"] = allocator.freed_total - freed_before
    # 2. A copy made by a step that never comes back, its request gone (ref_cnt 0): the
    #    undo evicts it through kvcached's evict_blocks, which frees its physical pages.
    w = make_request("w", tokens)
    fresh = pool.get_new_blocks(2)
    _step(guard, pool, w, fresh)
    pool.free_blocks(fresh)  # w aborted: cached blocks go to kvcached's evictable LRU
    ids = [b.block_id for b in fresh]
    in_lru = [i in pool._evictable_blocks for i in ids]
    freed_before = allocator.freed_total
    _empty_step_committed(guard)
    out["dropped"] = {
        "in_lru_before_undo": in_lru,
        "in_lru_after_undo": [i in pool._evictable_blocks for i in ids],
        "copy_unhashed": [b.block_hash is None for b in fresh],
        "physically_allocated": [i in allocator.allocated for i in ids],
        "freed_by_undo": allocator.freed_total - freed_before,
        **siblings_ok(),
    }
    out["stats"] = guard.counters()
    return out


def stale(path: str, same_content: bool) -> dict[str, Any]:
    """A record made stale by kvcached's own eviction, the block re-registered by another
    request since; the old step is then dropped. The record must be skipped and the new
    owner's entry must survive (``same_content``: its key is equal, not identical)."""
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from vllm_prefix_guard_harness.factory import make_request

    _, guard, pool, allocator = _guarded_pool()
    blocks = pool.get_new_blocks(2)
    ids = [b.block_id for b in blocks]
    a = make_request("A", list(range(1, 33)))
    _step(guard, pool, a, blocks)
    freed_before = allocator.freed_total
    if path == "cap_trim":  # kvcached's LRU cap, trimmed inside free_blocks
        pool.max_cached_blocks = 0
        pool.free_blocks(blocks)
        pool.max_cached_blocks = 1000
        everything = pool.get_new_blocks(allocator.available_size())
        reused = [b for b in everything if b.block_id in ids]
    elif path == "evict_blocks":  # a KV connector's evict_blocks, through kvcached's own
        pool.free_blocks(blocks)
        pool.evict_blocks(set(ids))
        everything = pool.get_new_blocks(allocator.available_size())
        reused = [b for b in everything if b.block_id in ids]
    elif path == "allocation_pressure":  # get_new_blocks evicts LRU victims to allocate
        pool.free_blocks(blocks)
        pool.get_new_blocks(allocator.available_size())
        reused = pool.get_new_blocks(2)
    else:
        raise ValueError(path)
    evicted = {
        "physically_freed": allocator.freed_total - freed_before,
        "hash_reset": [b.block_hash is None for b in blocks],
        "same_ids_reused": sorted(b.block_id for b in reused) == sorted(ids),
    }
    b = make_request("B", list(range(1, 33)) if same_content else list(range(500, 532)))
    output = _step(guard, pool, b, reused)
    guard.commit_step(output)  # A's step never came back: dropped, undone
    keys = [make_block_hash_with_group_id(h, 0) for h in b.block_hashes[:2]]
    hits = [pool.get_cached_block(b.block_hashes[i], [0]) for i in range(2)]
    return {
        "evicted": evicted,
        "stats": guard.counters(),
        "new_entries_survive": [
            pool.cached_block_hash_to_block.contain(k, blk.block_id)
            for k, blk in zip(keys, reused, strict=True)
        ],
        "new_owner_hits": [bool(h) and h[0] is blk for h, blk in zip(hits, reused, strict=True)],
        "kvcached_owns": [blk.block_id in pool._block_id_to_key for blk in reused],
    }


def pool_scenarios() -> dict[str, Any]:
    out: dict[str, Any] = {}
    jobs: dict[str, Callable[[], dict[str, Any]]] = {"duplicates": duplicates}
    for path in ("cap_trim", "evict_blocks", "allocation_pressure"):
        for same in (True, False):
            jobs[f"stale_{path}_{'same' if same else 'other'}_content"] = lambda p=path, s=same: (
                stale(p, s)
            )
    for name, job in jobs.items():
        try:
            out[name] = job()
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}", "where": _where()}
        Audit.current = None
    return out


# -- refusals and kvcached's own gate -------------------------------------------------


def _attempt(build: Callable[[], Any]) -> dict[str, Any]:
    try:
        scheduler = build()
    except Exception as exc:
        return {"error_type": f"{type(exc).__module__}.{type(exc).__name__}", "error": str(exc)}
    return {"pool": pool_info(scheduler)}


def legacy_refused() -> dict[str, Any]:
    """kvcached's legacy pool, forced on this vLLM: the guard refuses it at construction."""
    from vllm.v1.core import block_pool

    from vllm_prefix_guard_harness import factory

    published = getattr(block_pool, "ElasticBlockPool", None)
    block_pool.ElasticBlockPool = kvcached_cpu.legacy_pool_class()
    try:
        return _attempt(factory.make_scheduler)
    finally:
        block_pool.ElasticBlockPool = published


def engine_gate() -> dict[str, Any]:
    """kvcached's ``EngineCore.__init__`` gate with the factory's CPU config. The gate runs
    before vLLM's own ``__init__``, so no executor is needed to read its verdict."""
    from vllm.v1.engine.core import EngineCore

    from vllm_prefix_guard_harness.factory import SchedulerSpec, _vllm_config

    config = _vllm_config(SchedulerSpec())
    out: dict[str, Any] = {"use_v2_model_runner": getattr(config, "use_v2_model_runner", None)}
    engine = object.__new__(EngineCore)
    try:
        EngineCore.__init__(engine, config, executor_class=None, log_stats=False)
        out["result"] = "passed the gate"
    except Exception as exc:
        out["result"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
    return out


def without_kvcached_enabled(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``run`` with ``ENABLE_KVCACHED`` unset: kvcached's wrappers stay installed and
    read it at call time, so they step aside and vLLM's own pool is used."""
    os.environ.pop("ENABLE_KVCACHED", None)
    try:
        return run()
    finally:
        os.environ["ENABLE_KVCACHED"] = "1"


def patched_on_import() -> dict[str, Any]:
    """Import vLLM: in an interpreter started with kvcached's ``.pth`` its hook patches now."""
    import vllm
    from vllm.v1.core import block_pool

    return {
        "vllm": vllm.__version__,
        "elastic_block_pool": hasattr(block_pool, "ElasticBlockPool"),
        "autopatch_module": "kvcached.integration.vllm.autopatch" in sys.modules,
    }


def doctor() -> dict[str, Any]:
    """``vllm-prefix-guard doctor --json`` (its ``main``), in this kvcached-patched process."""
    import contextlib
    import io

    from vllm_prefix_guard.cli import main as cli

    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = cli(["doctor", "--json"])
    checks = {check["name"]: check for check in json.loads(buffer.getvalue())}
    return {"status": status, "checks": checks}


def kvcached_status() -> dict[str, Any]:
    from vllm_prefix_guard import kvcached_support

    status = kvcached_support.status()
    return {"describe": status.describe(), "version": status.version}


# -- the orders -------------------------------------------------------------------------


def _where() -> list[str]:
    return traceback.format_exc().strip().splitlines()[-4:]


def guarded_part(out: dict[str, Any]) -> None:
    from vllm_prefix_guard_harness import factory

    out["pool"] = _attempt(factory.make_scheduler)
    out["guarded"] = run_all()
    out["guarded_kv_events"] = kv_event_shapes()
    out["pool_level"] = pool_scenarios()
    out["legacy_refused"] = legacy_refused()
    out["guard_on_vllm_pool"] = without_kvcached_enabled(lambda: _attempt(factory.make_scheduler))
    out["status_enabled"] = kvcached_status()


def main(order: str) -> dict[str, Any]:
    from vllm_prefix_guard import plugin

    started = time.perf_counter()
    Audit.install_recorder()
    out: dict[str, Any] = {"order": order}
    if order == "guard_first":
        out["guard_patched"] = plugin.apply()
        out["patches"] = kvcached_cpu.activate()
        guarded_part(out)
        plugin.undo()
        out["alone"] = run_all()
        out["alone_kv_events"] = kv_event_shapes()
    elif order == "kvcached_first":
        out["patched_on_import"] = patched_on_import()
        out["doctor"] = doctor()
        out["patches"] = kvcached_cpu.activate()
        out["alone"] = run_all()
        out["alone_kv_events"] = kv_event_shapes()
        out["guard_patched"] = plugin.apply()
        guarded_part(out)
    elif order == "vllm_pool":
        from vllm_prefix_guard_harness import factory

        out["patched_on_import"] = patched_on_import()
        out["doctor"] = doctor()
        out["patches"] = kvcached_cpu.activate()
        out["guard_patched"] = plugin.apply()
        out["status_enabled"] = kvcached_status()

        def on_vllm_pool() -> dict[str, Any]:
            result = {
                "status": kvcached_status(),
                "zombie_sync": audited_verdict(lambda: zombie(False)),
            }
            plugin.undo()
            result["zombie_sync_unguarded"] = verdict(zombie(False))
            plugin.apply()
            return result

        out["kvcached_disabled"] = without_kvcached_enabled(on_vllm_pool)
        out["pool"] = _attempt(factory.make_scheduler)
        out["legacy_refused"] = legacy_refused()
    else:
        raise SystemExit(f"unknown order {order!r}")
    out["engine_gate"] = engine_gate()
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


if __name__ == "__main__":
    result = main(sys.argv[1])
    print("RESULT " + json.dumps(result, default=str), flush=True)
