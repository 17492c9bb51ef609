"""One lane of ``test_dynamo.py``, in a process of its own: vLLM's real scheduler (stock,
guarded, or guarded with a ``BlockStored`` per copy) publishing its KV events on ZMQ to
Dynamo's router and indexer; prints, as JSON, what each credits the engine with at every
checkpoint beside what the engine's prefix cache holds.

    python scheduler_lane.py {stock,guard,per-copy} [copies|orphan]

``copies`` (the default) evicts the two copies of block 1 one by one, then caches and
evicts the block twice more; ``orphan`` evicts block 0 while block 1 stays cached and
computes both again (the case the guard's stream leaves to the consumer: see
docs/operations.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dynamo_routers import BLOCK_SIZE, DynamoRouters, free_port

from vllm_prefix_guard import plugin, pool
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.pool_index import keys_cached_twice
from vllm_prefix_guard_harness.shadow_kv import Driver

PROMPT = list(range(1, BLOCK_SIZE + 1))


def engine_blocks(scheduler: Any, token_ids: list[int]) -> int:
    """Leading blocks of ``token_ids`` the engine's prefix cache holds (group 0)."""
    probe = make_request("probe", token_ids, BLOCK_SIZE)
    block_pool = scheduler.kv_cache_manager.block_pool
    held = 0
    for block_hash in probe.block_hashes:
        if block_pool.get_cached_block(block_hash, [0]) is None:
            break
        held += 1
    return held


def orphan(driver: Any, block_pool: Any, sequence: list[int], checkpoint: Any) -> None:
    """Block 0's copies are evicted while block 1 stays cached (no hit can reach it), then a
    request computes both again: block 1 is then cached twice, and block 0 once."""
    first = make_request("p", sequence, BLOCK_SIZE).block_hashes[0]
    key = next(k for k in keys_cached_twice(block_pool) if bytes(k).startswith(first))
    block_pool.evict_blocks({copy.block_id for copy in keys_cached_twice(block_pool)[key]})
    checkpoint("block 0 evicted, block 1 cached")
    driver.add(make_request("z", [*sequence, 7], BLOCK_SIZE, max_tokens=1))
    driver.run()
    checkpoint("both computed again")


def main(lane: str, scenario: str = "copies") -> None:
    if lane == "per-copy":  # the guard without its BlockStored rule (one event per copy)
        pool.store_first_copies = lambda *args: None  # type: ignore[assignment]
    if lane != "stock":
        plugin.apply()
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    port = free_port()
    scheduler = make_scheduler(num_blocks=40, kv_events=True, kv_events_endpoint=f"tcp://*:{port}")
    publisher = scheduler.kv_event_publisher

    def publish(events: list[Any]) -> None:
        publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def publish_sentinel(tokens: list[int]) -> None:
        publish(
            [
                BlockStored(
                    block_hashes=[tokens[0]],
                    parent_block_hash=None,
                    token_ids=tokens,
                    block_size=BLOCK_SIZE,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                )
            ]
        )

    routers = DynamoRouters(f"tcp://127.0.0.1:{port}", publish_sentinel)
    checkpoints = []
    try:
        driver = Driver(scheduler)
        for name in ("x", "y"):  # greedy twins: their decode block is cached twice
            driver.add(make_request(name, PROMPT, BLOCK_SIZE, max_tokens=24))
        driver.run()
        sequence = driver.worker.models["x"].tokens[: 2 * BLOCK_SIZE]
        block_pool = scheduler.kv_cache_manager.block_pool

        def checkpoint(name: str) -> None:
            publish(block_pool.take_events())
            routers.sync()
            checkpoints.append(
                {
                    "name": name,
                    "engine": engine_blocks(scheduler, sequence),
                    **routers.credited(sequence),
                }
            )

        checkpoint("both copies cached")
        if scenario == "orphan":
            orphan(driver, block_pool, sequence, checkpoint)
        else:
            copies(driver, block_pool, sequence, checkpoint)
    finally:
        routers.close()
        publisher.shutdown()
    print(json.dumps({"lane": lane, "violations": driver.violations, "checkpoints": checkpoints}))


def copies(driver: Any, block_pool: Any, sequence: list[int], checkpoint: Any) -> None:
    """Block 1's two copies are evicted one by one; then it is cached and evicted twice."""
    second = make_request("p", sequence, BLOCK_SIZE).block_hashes[1]
    key = next(k for k in keys_cached_twice(block_pool) if bytes(k).startswith(second))
    for index, copy in enumerate(keys_cached_twice(block_pool)[key]):
        block_pool.evict_blocks({copy.block_id})
        checkpoint(f"copy {index + 1} of 2 of block 1 evicted")
    for again in range(2):  # cached once more, then evicted: does a phantom recur?
        driver.add(make_request(f"z{again}", [*sequence, 7], BLOCK_SIZE, max_tokens=1))
        driver.run()
        checkpoint(f"block 1 cached again ({again + 1})")
        [held] = block_pool.get_cached_block(second, [0])
        block_pool.evict_blocks({held.block_id})
        checkpoint(f"block 1 evicted again ({again + 1})")


if __name__ == "__main__":
    main(*sys.argv[1:])
