"""KV-event consumers replayed beside a real scheduler, checked against its pool.

KV-aware routers know an engine's prefix cache only from its KV events, and read them two
ways. A *set* consumer (vllm-router's index, NVIDIA Dynamo's standalone indexer) keeps the
``(block hash, group)`` keys announced: ``BlockStored`` adds, ``BlockRemoved`` removes. A
*counting* consumer (Dynamo's ``KvEventPublisher`` with its ``EventDedupFilter``, llm-d's
filter) counts the ``BlockStored`` of each key and lets a ``BlockRemoved`` through only
when the count falls to 0; the key is announced while it is above 0. ``AllBlocksCleared``
empties both. After every engine step :meth:`KVEventReplay.check` compares each with the
pool's own index and counts the keys they disagree on:

- *missing*: cached, but the consumer believes them removed (it routes requests away from
  an engine that holds their prefix);
- *extra*: announced and no longer cached.

Events still queued in the pool (not yet taken by ``update_from_output``) count as
delivered: the check is what a consumer will believe once they are published. It also
counts the keys a consumer was told were stored (in a batch already published) that the
guard then rolled back: a router credited the engine with them for a step or more.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

Key = tuple[Any, int | None]


class KVEventReplay:
    """The two consumers of one scheduler's published KV events."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.kv_cache_utils import (
            get_block_hash,
            get_group_id,
            maybe_convert_block_hash,
        )

        self.scheduler = scheduler
        # The set consumer's keys, and the counting consumer's count per key.
        self.keys: set[Key] = set()
        self.counts: Counter[Key] = Counter()
        self.missing = self.extra = self.inconsistent_steps = 0
        self.counted_missing = self.counted_extra = self.counted_inconsistent_steps = 0
        # Keys announced stored (one per hash a published BlockStored lists), and those
        # a guard rollback then removed after they were published.
        self.stored = 0
        self.rolled_back_after_publish = 0
        # Pool key -> (hash, group) as events name it.
        self._named: dict[Any, Key] = {}
        self._get_block_hash = get_block_hash
        self._get_group_id = get_group_id
        self._convert = maybe_convert_block_hash
        publisher = scheduler.kv_event_publisher
        publish = publisher.publish

        def publish_and_replay(batch: Any) -> Any:
            self.stored += sum(
                len(e.block_hashes) for e in batch.events if type(e).__name__ == "BlockStored"
            )
            self.apply(batch.events)
            return publish(batch)

        publisher.publish = publish_and_replay
        self._meter_rollbacks(scheduler.kv_cache_manager.block_pool)

    def _meter_rollbacks(self, pool: Any) -> None:
        """Count the keys a guard rollback announces removed that a consumer already
        holds (their ``BlockStored`` was published): what waiting for the step's commit
        before publishing ``BlockStored`` would spare routers."""
        remove = getattr(pool, "remove_uncommitted_entry", None)
        if remove is None:  # stock vLLM: nothing is rolled back
            return

        def remove_and_meter(entry: Any) -> bool:
            queue = pool.kv_event_queue
            queued = len(queue)
            removed = bool(remove(entry))
            for event in queue[queued:]:
                if type(event).__name__ == "BlockRemoved":
                    announced = ((h, event.group_idx) for h in event.block_hashes)
                    self.rolled_back_after_publish += sum(k in self.keys for k in announced)
            return removed

        pool.remove_uncommitted_entry = remove_and_meter

    @staticmethod
    def enabled(scheduler: Any) -> bool:
        return bool(getattr(scheduler.kv_cache_manager.block_pool, "enable_kv_cache_events", False))

    def apply(
        self,
        events: Iterable[Any],
        keys: set[Key] | None = None,
        counts: Counter[Key] | None = None,
    ) -> None:
        """Replay ``events`` (the pool's, in order) into both consumers (default: this
        replay's own)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        keys = self.keys if keys is None else keys
        counts = self.counts if counts is None else counts
        for event in events:
            if isinstance(event, BlockStored):
                stored = [(h, event.group_idx) for h in event.block_hashes]
                keys.update(stored)
                counts.update(stored)
            elif isinstance(event, BlockRemoved):
                removed = [(h, event.group_idx) for h in event.block_hashes]
                keys.difference_update(removed)
                for key in removed:
                    if counts[key] > 1:
                        counts[key] -= 1
                    else:
                        del counts[key]  # 0: the filter lets BlockRemoved through
            elif isinstance(event, AllBlocksCleared):
                keys.clear()
                counts.clear()

    def cached_keys(self) -> set[tuple[Any, int | None]]:
        """The pool's keys, as events name them (each key converted once: the check
        runs after every step)."""
        index = self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        named = self._named
        for key in index._cache.keys() - named.keys():
            named[key] = (self._convert(self._get_block_hash(key)), self._get_group_id(key))
        return {named[key] for key in index._cache}

    def check(self) -> int:
        """Compare both consumers (with the events still queued) with the pool now; add
        up and return the keys they disagree on."""
        believed, counted = set(self.keys), Counter(self.counts)
        queued = list(self.scheduler.kv_cache_manager.block_pool.kv_event_queue)
        self.apply(queued, believed, counted)
        cached = self.cached_keys()
        missing, extra = len(cached - believed), len(believed - cached)
        self.missing += missing
        self.extra += extra
        self.inconsistent_steps += bool(missing or extra)
        credited = counted.keys()  # a count of 0 is deleted
        counted_missing, counted_extra = len(cached - credited), len(credited - cached)
        self.counted_missing += counted_missing
        self.counted_extra += counted_extra
        self.counted_inconsistent_steps += bool(counted_missing or counted_extra)
        return missing + extra + counted_missing + counted_extra
