"""The pool mixin on vLLM's real ``BlockPool``: duplicates, exact rollback, stale records.

Concurrent requests can materialise one ``(block_hash, group_id)`` in several physical
blocks (greedy-identical decodes). An index that keeps one block per key leaves the
siblings without ``block_hash`` and EngineCore dies on ``assert block.block_hash is not
None`` (kvcached #401/#402). Rolling back or evicting one block must leave its siblings
hashed and hittable.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest

from vllm_prefix_guard import plugin
from vllm_prefix_guard.errors import GuardUnsupportedError
from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard.pool import attach
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.pool_index import keys_cached_twice
from vllm_prefix_guard_harness.shadow_kv import Driver


def duplicated_decode_block() -> tuple[Any, Any, list[Any], list[int]]:
    """Two greedy-identical requests: their second block is one key in two blocks.

    Returns the scheduler, the key, its sibling blocks, and the tokens of the first two
    blocks (prompt plus the decoded tokens both requests produced).
    """
    scheduler = make_scheduler(num_blocks=40)
    driver = Driver(scheduler)
    for name in ("x", "y"):
        driver.add(make_request(name, list(range(1, 17)), max_tokens=24))
    driver.run()
    pool = scheduler.kv_cache_manager.block_pool
    key, siblings = next(iter(keys_cached_twice(pool).items()))
    assert driver.violations == 0
    return scheduler, key, siblings, driver.worker.models["x"].tokens[:32]


def guarded_pool(kv_events: bool = False) -> tuple[Any, UncommittedPrefixCache]:
    """vLLM's real pool of a fresh scheduler, attached, with the rules driven by hand.

    The plugin is applied for what the rules call on vLLM's ``KVCacheManager``
    (``rewind_num_cached_blocks``); no scheduler hook runs: nothing is scheduled.
    """
    plugin.apply()
    manager = make_scheduler(num_blocks=16, kv_events=kv_events).kv_cache_manager
    pool = attach(manager.block_pool)
    assert pool is manager.block_pool
    return pool, UncommittedPrefixCache(manager)


def failed_step() -> Any:
    """An output for a step that reports failed loads and admitted nobody."""
    from vllm.v1.core.sched.output import SchedulerOutput

    return SchedulerOutput.make_empty()


def _hit(pool: Any, key: Any) -> Any:
    return pool.cached_block_hash_to_block.get_one_block(key)


def test_evicting_one_duplicate_keeps_its_sibling(mode: str) -> None:
    scheduler, key, (first, second), _ = duplicated_decode_block()
    pool = scheduler.kv_cache_manager.block_pool
    pool.evict_blocks({first.block_id})
    assert first.block_hash is None
    assert second.block_hash == key and _hit(pool, key) is second


def test_rolling_back_a_duplicate_keeps_committed_siblings(guard: None) -> None:
    """A third, uncommitted copy of the same block is rolled back; the two committed
    siblings keep their hash and stay hittable (kvcached #401 shape)."""
    scheduler, key, siblings, tokens = duplicated_decode_block()
    pool = scheduler.kv_cache_manager.block_pool
    guard = guard_of(scheduler)
    assert guard is not None
    z = make_request("z", tokens)
    guard.begin_step()
    fresh = pool.get_new_blocks(2)
    pool.cache_full_blocks(z, fresh, 0, 2, 16, 0)
    assert key in {block.block_hash for block in fresh}
    guard.preempted(z)  # nothing computed: every entry of its step goes
    assert all(block.block_hash is None for block in fresh)
    assert all(sibling.block_hash == key for sibling in siblings)
    assert _hit(pool, key) in siblings


def test_rollback_removes_exactly_one_pair_and_no_key_another_block_caches() -> None:
    """Three blocks under one key; rolling back the uncommitted one leaves two, and the
    key stays announced (no ``BlockRemoved``) until the last of them goes."""
    pool, rules = guarded_pool(kv_events=True)
    request = make_request("r", list(range(1, 17)))
    committed = pool.get_new_blocks(2)
    for block in committed:
        pool.cache_full_blocks(request, [block], 0, 1, 16, 0)
    key = committed[0].block_hash
    rules.begin_step()
    (fresh,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [fresh], 0, 1, 16, 0)
    assert pool.cached_block_hash_to_block.contain(key, fresh.block_id)
    pool.take_events()
    rules.rollback_preempted("r", 0)
    assert fresh.block_hash is None
    assert not pool.cached_block_hash_to_block.contain(key, fresh.block_id)
    assert all(pool.cached_block_hash_to_block.contain(key, b.block_id) for b in committed)
    assert pool.take_events() == []
    assert pool.guard_removed == 1
    pool.evict_blocks({committed[0].block_id})
    assert pool.take_events() == []
    pool.evict_blocks({committed[1].block_id})
    (event,) = pool.take_events()
    assert type(event).__name__ == "BlockRemoved"


def test_rollback_skips_a_block_evicted_and_reused_since() -> None:
    pool, rules = guarded_pool()
    a = make_request("a", list(range(1, 17)))
    rules.begin_step()
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(a, [block], 0, 1, 16, 0)
    rules.end_step(output := failed_step())
    # The block is freed, evicted for reuse and re-registered under the same key by b.
    pool.free_blocks([block])
    while True:
        (again,) = pool.get_new_blocks(1)
        if again is block:
            break
    b = make_request("b", list(range(1, 17)))
    pool.cache_full_blocks(b, [block], 0, 1, 16, 0)
    rollback = FailedKVLoads(rules)
    rollback.roll_back(output, {block.block_id})
    assert rollback.loaders == {"a": {block.block_id}}
    assert block.block_hash is not None  # b's registration survives
    assert pool.stale_entries_skipped == 1
    assert pool.guard_removed == 0


def test_partial_key_rolls_back_alone() -> None:
    """A secondary (partial prefix) key is removed without touching the block's primary."""
    pool, rules = guarded_pool()
    request = make_request("r", list(range(1, 33)))
    (block,) = pool.get_new_blocks(1)
    # A 32-token cache block over 16-token hashes (hybrid layouts): full key at 32 tokens,
    # then a partial entry at the 16-token boundary inside it.
    pool.cache_full_blocks(request, [block], 0, 1, 32, 0)
    primary = block.block_hash
    rules.begin_step()
    secondary = pool.cache_partial_block(request, block, 16, 0, 32)
    assert secondary is not None and secondary != primary
    rules.rollback_preempted("r", 0)
    assert block.block_hash == primary
    assert not pool.cached_block_hash_to_block.contain(secondary, block.block_id)
    assert block.block_id not in pool.cached_block_hashes_by_block


def test_a_committed_partial_entry_is_not_lost_to_a_rolled_back_full_key() -> None:
    """Can rolling back a block's primary key take a *committed* partial key with it?
    No: an uncommitted full key never sits beside a committed partial one. When the full
    key is registered on a block that carries a partial key, vLLM itself removes the
    partial key first (``cache_full_blocks``' partial->full promotion), whether the guard
    runs or not; a partial key added after a full key is rolled back alone (above)."""
    pool, rules = guarded_pool()
    request = make_request("r", list(range(1, 33)))
    (block,) = pool.get_new_blocks(1)
    rules.begin_step()
    partial = pool.cache_partial_block(request, block, 16, 0, 32)
    assert partial is not None and block.block_hash is partial  # a partial primary
    rules.end_step(written := object())
    rules.commit_step(written)
    assert len(rules.step_id_to_entries) == 0 and pool.uncommitted_entries is None
    rules.begin_step()
    pool.cache_full_blocks(request, [block], 0, 1, 32, 0)
    full = block.block_hash
    assert full is not None and full != partial
    # vLLM's promotion dropped the committed partial entry before the guard did anything.
    assert not pool.cached_block_hash_to_block.contain(partial, block.block_id)
    rules.rollback_preempted("r", 0)
    assert block.block_hash is None
    assert block.block_id not in pool.cached_block_hashes_by_block
    assert pool.guard_removed == 1


def test_the_guard_runs_on_vllms_own_pool_object(guard: None) -> None:
    """The patches sit on vLLM's ``BlockPool`` class: the pool is vLLM's own object, its
    class unchanged, shared by every manager, and its blocks' weak reference to it (vLLM
    0.34) still resolves; attaching again keeps its records."""
    from vllm.v1.core.block_pool import BlockPool

    scheduler = make_scheduler()
    pool = scheduler.kv_cache_manager.block_pool
    assert type(pool) is BlockPool
    guard = guard_of(scheduler)
    assert guard is not None and guard.pool is pool
    managers = scheduler.kv_cache_manager.coordinator.single_type_managers
    assert all(m.block_pool is pool for m in managers)
    owners = [b.pool() if isinstance(b.pool, weakref.ref) else b.pool for b in pool.blocks]
    assert all(owner is pool for owner in owners)
    kept = pool.kept_block_owners
    assert attach(pool) is pool and pool.kept_block_owners is kept


def test_a_pool_without_the_needed_internals_is_refused() -> None:
    class ForeignPool:
        enable_caching = True

    with pytest.raises(GuardUnsupportedError, match="VLLM_PREFIX_GUARD=0"):
        attach(ForeignPool())


def test_a_pool_that_is_no_block_pool_is_refused(guard: None) -> None:
    """A class with every method and field of vLLM's ``BlockPool`` but not derived from
    it never runs the wrappers on ``BlockPool``: refused with the names, not passed."""
    from vllm.v1.core.block_pool import BlockPool

    imitation = type("Imitation", (), dict(vars(BlockPool)))
    with pytest.raises(GuardUnsupportedError, match="cache_full_blocks calling BlockPool's"):
        attach(imitation)


def test_an_override_that_skips_vllms_method_is_refused(guard: None) -> None:
    """A pool class that registers without going through ``BlockPool``'s wrapped method
    would escape the guard: the scheduler refuses to start on it."""
    from vllm.v1.core.block_pool import BlockPool

    class SkippingPool(BlockPool):
        def move_block_hashes(self, src_block, dst_block):  # type: ignore[no-untyped-def]
            dst_block.block_hash = src_block.block_hash
            self.cached_block_hash_to_block.insert(dst_block.block_hash, dst_block)

    pool = make_scheduler().kv_cache_manager.block_pool
    pool.__class__ = SkippingPool
    with pytest.raises(GuardUnsupportedError, match="move_block_hashes calling BlockPool's"):
        attach(pool)


def test_disabled_prefix_caching_gets_no_guard() -> None:
    plugin.apply()
    scheduler = make_scheduler(enable_prefix_caching=False)
    assert guard_of(scheduler) is None
    driver = Driver(scheduler)
    driver.add(make_request("a", list(range(1, 40))))
    driver.run()
    assert driver.violations == 0


def test_pool_replaced_after_construction_is_guarded(guard: None) -> None:
    """kvcached swaps its own pool in after vLLM's coordinator ``__init__``; the guard
    attaches to whatever pool the scheduler's manager holds once it is built."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    class ReplacementPool(BlockPool):
        pass

    original_init = KVCacheCoordinator.__init__

    def replacing_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        old = self.block_pool
        self.block_pool = ReplacementPool(
            old.num_gpu_blocks, old.enable_caching, old.hash_block_size
        )
        for manager in self.single_type_managers:
            manager.block_pool = self.block_pool
            manager._null_block = self.block_pool.null_block

    KVCacheCoordinator.__init__ = replacing_init  # type: ignore[method-assign]
    try:
        scheduler = make_scheduler()
    finally:
        KVCacheCoordinator.__init__ = original_init  # type: ignore[method-assign]
    pool = scheduler.kv_cache_manager.block_pool
    assert isinstance(pool, ReplacementPool)
    guard = guard_of(scheduler)
    assert guard is not None and guard.pool is pool and pool.guard_attached


def test_a_partial_key_registered_again_since_is_not_rolled_back() -> None:
    """Records are told apart by identity: the block lost its keys and got equal ones again
    (a later registration, written by then); rolling back the old record must not take it."""
    pool, rules = guarded_pool()
    request = make_request("r", list(range(1, 33)))
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_blocks(request, [block], 0, 1, 32, 0)
    rules.begin_step()
    recorded = pool.cache_partial_block(request, block, 16, 0, 32)
    rules.end_step(output := failed_step())
    pool.evict_blocks({block.block_id})
    pool.cache_full_blocks(request, [block], 0, 1, 32, 0)
    again = pool.cache_partial_block(request, block, 16, 0, 32)
    assert again == recorded and again is not recorded
    rollback = FailedKVLoads(rules)
    rollback.roll_back(output, {block.block_id})
    assert rollback.loaders == {"r": {block.block_id}}
    assert pool.cached_block_hash_to_block.contain(again, block.block_id)
    assert pool.stale_entries_skipped == 1
    assert pool.guard_removed == 0


def test_preemption_keeps_entries_its_dispatched_steps_write() -> None:
    """Under async scheduling a block's last token is known only once the step that
    sampled it reports, so the block is registered one step after the step that writes
    its KV. A victim preempted in that later step keeps the entry: the dispatched step
    writes the block. It moves to that step's record (a failure or drop there removes
    it); the victim's entries past its computed tokens go."""
    pool, rules = guarded_pool()
    request = make_request("r", list(range(1, 49)))
    blocks = pool.get_new_blocks(3)
    rules.begin_step()
    rules.end_step(in_flight := failed_step())  # writes tokens 0-31 (blocks 0 and 1)
    rules.begin_step()
    pool.cache_full_blocks(request, blocks, 0, 3, 16, 0)  # 16, 32: written; 48: not yet
    rules.rollback_preempted("r", num_written_tokens=32)
    assert [b.block_hash is not None for b in blocks] == [True, True, False]
    assert pool.guard_removed == 1
    rules.end_step(failed_step())
    assert blocks[0].block_hash is not None
    assert sum(len(e) for _, step in rules.steps_in_flight() for e in step.values()) == 2
    FailedKVLoads(rules).roll_back(in_flight, {blocks[0].block_id})
    assert all(b.block_hash is None for b in blocks)


def test_preemption_without_computed_tokens_rolls_back_everything() -> None:
    pool, rules = guarded_pool()
    request = make_request("r", list(range(1, 33)))
    blocks = pool.get_new_blocks(2)
    rules.begin_step()
    pool.cache_full_blocks(request, blocks, 0, 2, 16, 0)
    rules.rollback_preempted("r", num_written_tokens=0)
    assert all(b.block_hash is None for b in blocks)


def test_the_pool_counters_shadow_nothing_of_vllm() -> None:
    """The mixin's counters carry the names the stats and ``/metrics`` use (no ``guard_``
    prefix), so none may be a name vLLM's pool has."""
    from vllm.v1.core.block_pool import BlockPool

    from vllm_prefix_guard import targets

    vllm_names = set(dir(BlockPool)) | targets.constructor_stores(BlockPool)
    assert "stale_entries_skipped" not in vllm_names


def test_the_wrappers_read_a_blocks_hash_as_vllm_does() -> None:
    """The registration path reads ``block_hash`` without vLLM's property frame where there
    is one (0.30-0.33), and the same value: unset, set, reset."""
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    from vllm_prefix_guard.pool import block_hash_getter

    block_hash = block_hash_getter()
    block = KVCacheBlock(3)
    assert block_hash(block) is None
    block.set_block_hash(key := object(), num_tokens=32)  # type: ignore[arg-type]
    assert block_hash(block) is key is block.block_hash
    block.reset_hash()
    assert block_hash(block) is None
    field = (
        "_block_hash"
        if isinstance(vars(KVCacheBlock).get("block_hash"), property)
        else "block_hash"
    )
    assert block_hash.__reduce__()[1] == (field,)
