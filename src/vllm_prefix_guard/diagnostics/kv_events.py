"""A KV-event consumer replayed beside a real scheduler, checked against its pool.

KV-aware routers know an engine's prefix cache only from its KV events. This consumer
keeps what such a router keeps, the set of ``(block hash, group)`` keys the engine
caches: ``BlockStored`` adds its hashes (a second copy of a key adds nothing: the set is
idempotent), ``BlockRemoved`` removes them, ``AllBlocksCleared`` empties it. After every
engine step :meth:`KVEventReplay.check` compares that set with the pool's own index and
counts the keys they disagree on:

- *missing*: cached, but the consumer was told they were removed (a ``BlockRemoved``
  while another block still caches the key: the consumer routes requests away from an
  engine that holds their prefix);
- *extra*: announced, never removed, no longer cached.

Events still queued in the pool (not yet taken by ``update_from_output``) count as
delivered: the check is what a consumer will believe once they are published.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class KVEventReplay:
    """The consumer of one scheduler's published KV events."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.kv_cache_utils import (
            get_block_hash,
            get_group_id,
            maybe_convert_block_hash,
        )

        self.scheduler = scheduler
        self.keys: set[tuple[Any, int | None]] = set()
        self.missing = 0
        self.extra = 0
        self.inconsistent_steps = 0
        # Pool key -> (hash, group) as events name it.
        self._named: dict[Any, tuple[Any, int | None]] = {}
        self._get_block_hash = get_block_hash
        self._get_group_id = get_group_id
        self._convert = maybe_convert_block_hash
        publisher = scheduler.kv_event_publisher
        publish = publisher.publish

        def publish_and_replay(batch: Any) -> Any:
            self.apply(batch.events)
            return publish(batch)

        publisher.publish = publish_and_replay

    @staticmethod
    def enabled(scheduler: Any) -> bool:
        return bool(getattr(scheduler.kv_cache_manager.block_pool, "enable_kv_cache_events", False))

    def apply(self, events: Iterable[Any], keys: set[tuple[Any, int | None]] | None = None) -> None:
        """Replay ``events`` (the pool's, in order) into ``keys`` (default: the consumer's)."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        keys = self.keys if keys is None else keys
        for event in events:
            if isinstance(event, BlockStored):
                keys.update((h, event.group_idx) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                keys.difference_update((h, event.group_idx) for h in event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                keys.clear()

    def cached_keys(self) -> set[tuple[Any, int | None]]:
        """The pool's keys, as events name them (each key converted once: the check
        runs after every step)."""
        index = self.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
        named = self._named
        for key in index._cache.keys() - named.keys():
            named[key] = (self._convert(self._get_block_hash(key)), self._get_group_id(key))
        return {named[key] for key in index._cache}

    def check(self) -> int:
        """Compare the consumer (with the events still queued) with the pool now; add
        and return the keys they disagree on."""
        believed = set(self.keys)
        self.apply(list(self.scheduler.kv_cache_manager.block_pool.kv_event_queue), believed)
        cached = self.cached_keys()
        missing, extra = len(cached - believed), len(believed - cached)
        self.missing += missing
        self.extra += extra
        self.inconsistent_steps += bool(missing or extra)
        return missing + extra
