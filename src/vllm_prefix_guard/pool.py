"""A mixin grafted onto the scheduler's live ``BlockPool``: what the upstream series adds to it.

vLLM's ``BlockHashToBlockMap`` already keeps every physical block registered under a
key (``key -> {block_id: block}``): concurrent requests that materialise the same prefix
each own a block under the same ``(block_hash, group_id)``. The mixin keeps that
multi-block index as the single source of truth and adds what the upstream series adds
to ``BlockPool`` (``upstream/series.py``), grafted instead of edited in:

- *recording*: while ``uncommitted_entries`` holds the open step's record (set by
  :class:`~vllm_prefix_guard.rules.uncommitted.UncommittedPrefixCache`), every
  ``(key, block)`` pair that ``_insert_block_hash`` newly adds is appended to it, under
  the request whose ``cache_full_blocks`` / ``cache_partial_block`` call made it, with
  the prefix length the key names (the series passes ``request_id`` down instead);
- *exact removal*: ``remove_uncommitted_entry``, inherited verbatim from
  :mod:`vllm_prefix_guard.rules.block_pool`, plus one branch only a plugin needs: a pool
  whose ``evict_blocks`` does more than drop hashes (kvcached's returns the block's
  physical pages) evicts an unreferenced block through it;
- *events per hash*: ``BlockRemoved`` for a hash only once no block caches it any more
  (``uncached_block_hashes``, from the rules), on every path that removes one: vLLM's
  eviction, partial-to-full promotion and the rules' rollbacks, whichever pool; and with
  KV events on, ``BlockStored`` only when the first block caches it
  (:class:`FirstCopyStoredEvents`, ``first_copy_events``).

It also counts what it recorded and removed, and bumps :attr:`guard_epoch` on every
successful ``reset_prefix_cache``: the scheduler hooks read these, never the other way.
vLLM's own pool is built guarded (:class:`GuardedBlockPool` stands for ``BlockPool`` in
the coordinator's module); a pool built elsewhere and assigned later (kvcached's) is
grafted in place (:func:`graft`), whatever its class, so the mixin relies on no
constructor: ``_guard_init_state`` sets its state up.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vllm_prefix_guard import kvcached_support, targets
from vllm_prefix_guard.rules.block_pool import (
    BlockPoolAdditions,
    StepCacheEntries,
    UncommittedEntry,
)

if TYPE_CHECKING:
    _PoolBase = Any
else:
    _PoolBase = object


class PrefixGuardPool(BlockPoolAdditions, _PoolBase):
    """Cooperative mixin: every override runs the next implementation (the grafted
    class's own), passing every argument through."""

    # The open step's record (None: no step open, or KV already written).
    uncommitted_entries: StepCacheEntries | None
    # Request whose cache_*_block call is running; None for pool-driven moves (Mamba CoW).
    _guard_request_id: str | None
    # Bumped on every successful reset_prefix_cache (which drops all hashes at once).
    guard_epoch: int
    # vLLM's own flag: KV events are published.
    enable_kv_cache_events: bool
    # The pool's own evict_blocks does more than drop hashes (kvcached's returns the
    # block's physical pages): an undone block nobody holds is evicted through it.
    _guard_evict_releases: bool
    # Entries recorded; entries removed that were still cached, and that were not.
    registrations_tracked: int
    guard_removed: int
    stale_entries_skipped: int
    # The grafted class's own implementation of each targets.FORWARDED method (graft() binds
    # them per guarded class, as static functions called with the pool).
    _next_cache_full_blocks: Callable[..., Any]
    _next_cache_partial_block: Callable[..., Any]
    _next_insert_block_hash: Callable[..., Any]
    _next_emit_block_removed_events: Callable[..., Any]

    def _guard_init_state(self) -> None:
        self.uncommitted_entries = None
        self._guard_request_id = None
        self.guard_epoch = 0
        self.registrations_tracked = self.guard_removed = self.stale_entries_skipped = 0
        self.kept_block_owners = set()
        native = targets.resolve(targets.BLOCK_POOL, "BlockPool").evict_blocks
        self._guard_evict_releases = type(self).evict_blocks is not native

    # -- recording -------------------------------------------------------------------

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Any = None,
    ) -> Any:
        if self.kept_block_owners and self.cache_around_kept_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        ):
            return None  # blocks a failed load's rollback kept (the series' part 2)
        if self.uncommitted_entries is None:
            return self._next_cache_full_blocks(
                self,
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
        self._guard_request_id = request.request_id
        try:
            return self._next_cache_full_blocks(
                self,
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
        finally:
            self._guard_request_id = None

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        if self.uncommitted_entries is None:
            return self._next_cache_partial_block(
                self,
                request,
                block,
                num_tokens,
                kv_cache_group_id,
                block_size,
                replace_existing_hashes,
            )
        self._guard_request_id = request.request_id
        try:
            return self._next_cache_partial_block(
                self,
                request,
                block,
                num_tokens,
                kv_cache_group_id,
                block_size,
                replace_existing_hashes,
            )
        finally:
            self._guard_request_id = None

    def _insert_block_hash(
        self, block_hash_with_group_id: Any, block: Any, num_tokens: int | None
    ) -> Any:
        entries = self.uncommitted_entries
        if entries is None:
            return self._next_insert_block_hash(self, block_hash_with_group_id, block, num_tokens)
        key = block_hash_with_group_id
        # vLLM's own test for "already registered" (equality), asked before it acts: an
        # unhashed block is in no entry yet (every removal path clears all of its keys).
        held = block.block_hash
        is_new = held is None or (
            held != key and not self.cached_block_hash_to_block.contain(key, block.block_id)
        )
        result = self._next_insert_block_hash(self, key, block, num_tokens)
        if is_new:
            # num_tokens: the prefix length the key names (which tokens' KV it must hold).
            request_entries = entries.get(self._guard_request_id)
            if request_entries is None:
                entries[self._guard_request_id] = [(key, block, num_tokens)]
            else:
                request_entries.append((key, block, num_tokens))
            self.registrations_tracked += 1
        return result

    def _emit_block_removed_events(self, block_hashes: Any) -> Any:
        # A hash another block still caches is not removed (the series' part 3).
        if block_hashes and self.enable_kv_cache_events:
            block_hashes = self.uncached_block_hashes(block_hashes)
        return self._next_emit_block_removed_events(self, block_hashes)

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        reset = super().reset_prefix_cache(*args, **kwargs)
        if reset:
            self.guard_epoch += 1
        return reset

    # -- removal ---------------------------------------------------------------------

    def remove_uncommitted_entry(self, entry: UncommittedEntry) -> bool:
        key, block, _ = entry
        if block.block_hash is key and block.ref_cnt == 0 and self._guard_evict_releases:
            self.evict_blocks({block.block_id})
            removed = True
        else:
            removed = super().remove_uncommitted_entry(entry)
        if removed:
            self.guard_removed += 1
        else:
            self.stale_entries_skipped += 1
        return removed


class FirstCopyStoredEvents:
    """With KV events on: ``BlockStored`` only for a hash no other block caches (the series'
    part 3, ``first_copy_events``), as ``BlockRemoved`` only for the last copy. Outermost
    in the guarded class's MRO: each override runs the guarded pool's own (``super()``)
    and rewrites the events it queued."""

    kv_event_queue: list[Any]
    cached_block_hash_to_block: Any
    # ``(num_tokens, first copy)`` of each block the running ``cache_*`` call inserts.
    _guard_copies: list[tuple[int, bool]] | None = None

    def cache_full_blocks(
        self,
        request: Any,
        blocks: Any,
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Any = None,
    ) -> Any:
        queue = self.kv_event_queue
        queued = len(queue)
        outer, self._guard_copies = self._guard_copies, []
        try:
            result = super().cache_full_blocks(  # type: ignore[misc]
                request,
                blocks,
                num_cached_blocks,
                num_full_blocks,
                block_size,
                kv_cache_group_id,
                block_mask,
            )
        finally:
            copies, self._guard_copies = self._guard_copies, outer
        if (
            copies
            and not all(first for _, first in copies)
            and len(queue) > queued
            and type(queue[-1]).__name__ == "BlockStored"
        ):
            stored = queue.pop()
            positions = [(n // block_size - 1 - num_cached_blocks, first) for n, first in copies]
            queue.extend(BlockPoolAdditions.first_copy_events(stored, positions))
        return result

    def cache_partial_block(
        self,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        queue = self.kv_event_queue
        queued = len(queue)
        outer, self._guard_copies = self._guard_copies, []
        try:
            result = super().cache_partial_block(  # type: ignore[misc]
                request, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes
            )
        finally:
            copies, self._guard_copies = self._guard_copies, outer
        if (
            copies
            and not copies[-1][1]
            and len(queue) > queued
            and type(queue[-1]).__name__ == "BlockStored"
        ):
            queue.pop()  # its one BlockStored: another block caches the hash
        return result

    def _insert_block_hash(
        self, block_hash_with_group_id: Any, block: Any, num_tokens: int | None
    ) -> Any:
        copies = self._guard_copies
        if copies is not None:
            first = self.cached_block_hash_to_block.get_one_block(block_hash_with_group_id) is None
            copies.append((num_tokens or 0, first))
        return super()._insert_block_hash(  # type: ignore[misc]
            block_hash_with_group_id, block, num_tokens
        )


_GUARDED_CLASSES: dict[tuple[type, bool], type] = {}


def missing_pool_internals(pool: Any) -> list[str]:
    """Names of the pool internals (:data:`targets.POOL_INTERNALS`) ``pool`` lacks.

    ``pool`` is a live pool (attributes looked up on it) or a pool class (instance
    attributes read from its constructors, as the start-up checks do).
    """
    is_class = isinstance(pool, type)
    index = None if is_class else getattr(pool, "cached_block_hash_to_block", None)
    missing = []
    for internal in targets.POOL_INTERNALS:
        owner, name = internal.owner, internal.name
        if owner == "BlockPool":
            present = (
                targets.has_instance_attribute(pool, name) if is_class else hasattr(pool, name)
            )
        elif owner == "BlockHashToBlockMap" and not is_class:
            present = index is not None and hasattr(index, name)
        else:  # blocks and the index's class: checked on vLLM's classes at start-up
            continue
        if not present:
            missing.append(internal.path)
    return missing


def next_implementations(base: type) -> dict[str, staticmethod[..., Any]]:
    """``_next_<name>`` -> ``base``'s own implementation of each method in
    :data:`targets.FORWARDED`.

    Raises:
        GuardUnsupportedError: one of them takes other parameters than FORWARDED names
            (the override forwards exactly those).
    """
    bound: dict[str, staticmethod[..., Any]] = {}
    for name, parameters in targets.FORWARDED.items():
        implementation = getattr(base, name)
        taken = tuple(inspect.signature(implementation).parameters)[1:]
        if taken != parameters:
            raise targets.unsupported(
                f"{base.__module__}.{base.__qualname__}.{name}",
                f"takes ({', '.join(taken)}), not ({', '.join(parameters)})",
                kvcached_support.refusal_hint(base),
            )
        bound[f"_next_{name.lstrip('_')}"] = staticmethod(implementation)
    return bound


def guarded_class(base: Any, kv_events: bool) -> type:
    """``PrefixGuarded<Base>``: the mixin over ``base``, built once per base and events
    setting, so ``__mro__`` reads ``PrefixGuarded<Base> -> PrefixGuardPool ->
    BlockPoolAdditions -> <Base> -> ...``.

    With KV events off nothing is emitted: the class keeps the pool's own emitter, and
    eviction (several calls a step) pays no override.

    Raises:
        GuardUnsupportedError: a forwarded method of ``base`` takes other parameters.
    """
    guarded = _GUARDED_CLASSES.get((base, kv_events))
    if guarded is None:
        namespace: dict[str, Any] = {"__module__": __name__, **next_implementations(base)}
        bases: tuple[type, ...] = (PrefixGuardPool, base)
        if kv_events:
            bases = (FirstCopyStoredEvents, *bases)
        else:
            namespace["_emit_block_removed_events"] = base._emit_block_removed_events

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            base.__init__(self, *args, **kwargs)
            self._guard_init_state()

        namespace["__init__"] = __init__
        guarded = type(f"PrefixGuarded{base.__name__}", bases, namespace)
        _GUARDED_CLASSES[(base, kv_events)] = guarded
    return guarded


class GuardedBlockPool:
    """What vLLM's coordinator builds in place of ``BlockPool`` while the guard is on
    (``hooks`` binds it as ``kv_cache_coordinator.BlockPool``): the guarded class of
    vLLM's own pool, for the events setting asked for. The pool is born guarded, so no
    class is ever reassigned on it: CPython 3.11 turns an object's inline attributes
    into a dict when its ``__class__`` is reassigned, which slows every later access of
    vLLM's to it (measured: +1.5% instructions per scheduler step at 256 running).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        base = targets.resolve(targets.BLOCK_POOL, "BlockPool")
        kv_events = bool(kwargs.get("enable_kv_cache_events", False))
        return guarded_class(base, kv_events)(*args, **kwargs)


def graft(pool: Any) -> Any:
    """Make a pool built elsewhere a :class:`PrefixGuardPool` (kvcached's replacement,
    assigned after vLLM's coordinator built its own); idempotent; returns ``pool``.

    Its class is swapped in place: others may hold it already, so its identity is kept.

    Raises:
        GuardUnsupportedError: the pool lacks an internal the guard relies on.
    """
    if isinstance(pool, PrefixGuardPool):
        return pool
    base = type(pool)
    missing = missing_pool_internals(pool)
    if missing:
        raise targets.unsupported(
            f"the KV-cache block pool {base.__module__}.{base.__qualname__}",
            f"has no {', '.join(missing)}",
            kvcached_support.refusal_hint(base),
        )
    pool.__class__ = guarded_class(base, bool(getattr(pool, "enable_kv_cache_events", False)))
    pool._guard_init_state()
    return pool
