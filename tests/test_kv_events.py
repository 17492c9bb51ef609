"""KV events stay true when one key is cached in several blocks.

KV-aware routers build their picture of an engine's prefix cache from its KV events
alone. Requests that compute the same prefix concurrently each fill a block of their
own, so one ``(block_hash, group_id)`` is cached in several blocks (what vLLM's
``BlockHashToBlockMap`` keeps; kvcached #401/#402). ``BlockRemoved`` for the key is
then true only once the last of those blocks loses it; emitted earlier, a router routes
requests away from the engine that still holds their prefix. Two shapes, checked by a
consumer replayed from the event stream against the pool's index
(:class:`~vllm_prefix_guard.diagnostics.kv_events.KVEventReplay`):

- vLLM evicts one copy for reuse (stock vLLM emits ``BlockRemoved``; open vLLM PR
  #55092's shape);
- the guard rolls back one copy (a request preempted in the ``schedule()`` that
  registered it) while another request's block keeps the key.
"""

from __future__ import annotations

from typing import Any

from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.kv_events import KVEventReplay
from vllm_prefix_guard.diagnostics.shadow_kv import Driver


def two_copies_of_a_decode_block() -> tuple[Any, KVEventReplay, Any, list[Any]]:
    """Two greedy-identical requests, run to the end: their second block is one key in
    two blocks, both cached and free. Returns the scheduler, the consumer, the key and
    its two blocks."""
    scheduler = make_scheduler(num_blocks=40, kv_events=True)
    replay = KVEventReplay(scheduler)
    driver = Driver(scheduler)
    for name in ("x", "y"):
        driver.add(make_request(name, list(range(1, 17)), max_tokens=24))
    driver.run()
    index = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    key, blocks = next((k, v) for k, v in index._cache.items() if isinstance(v, dict))
    assert driver.violations == 0 and replay.check() == 0
    return scheduler, replay, key, list(blocks.values())


def test_evicting_one_copy_keeps_the_key_announced(mode: str) -> None:
    scheduler, replay, key, (first, second) = two_copies_of_a_decode_block()
    pool = scheduler.kv_cache_manager.block_pool
    pool.evict_blocks({first.block_id})  # what allocating it for reuse does
    assert pool.cached_block_hash_to_block.get_one_block(key) is second  # still hits
    missing = replay.check()
    if mode == "stock":
        assert missing == 1, "stock vLLM announces the cached key as removed"
        return
    assert missing == 0
    pool.evict_blocks({second.block_id})
    assert replay.check() == 0 and pool.cached_block_hash_to_block.get_one_block(key) is None


def test_rolling_back_one_copy_keeps_the_key_announced(mode: str) -> None:
    """X and Y decode greedy-identical blocks; W's prefill chunk cannot allocate in the
    step where both register their copy of block 2, and Y (lower priority) is preempted
    after registering its copy, which that step will never write. Found by search over
    pool sizes and arrival steps (9 blocks, W at step 14)."""
    scheduler = make_scheduler(
        num_blocks=9,
        policy="priority",
        long_prefill_token_threshold=32,
        max_num_batched_tokens=256,
        kv_events=True,
    )
    replay = KVEventReplay(scheduler)
    driver = Driver(scheduler)
    prompt = list(range(1, 17))
    driver.add(make_request("X", prompt, max_tokens=40, priority=0, arrival_time=0.0))
    driver.add(make_request("Y", prompt, max_tokens=40, priority=1, arrival_time=1.0))
    index = scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
    copies_after_preemption = None
    disagreements = []
    for step in range(400):
        if step == 14:
            w = make_request("W", list(range(500, 564)), max_tokens=4, arrival_time=2.0)
            driver.add(w)
        if not (scheduler.has_requests() or driver.in_flight):
            break
        output = driver.schedule()
        if copies_after_preemption is None and "Y" in (output.preempted_req_ids or ()):
            x_blocks = scheduler.kv_cache_manager.get_block_ids("X")[0]
            key = scheduler.kv_cache_manager.block_pool.blocks[x_blocks[1]].block_hash
            held = index._cache.get(key)
            copies_after_preemption = len(held) if isinstance(held, dict) else int(bool(held))
        driver.complete()
        if replay.check():
            disagreements.append(step)
    assert copies_after_preemption is not None, "the layout no longer preempts Y"
    if mode == "stock":
        # Y's copy, never to be written, stays cached until W's allocation evicts it in
        # that same call, and that eviction announces the key X still caches as removed.
        assert disagreements
        return
    assert copies_after_preemption == 1 and driver.violations == 0
    assert disagreements == [], f"the consumer disagreed with the cache after {disagreements}"
