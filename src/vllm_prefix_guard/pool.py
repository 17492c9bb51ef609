"""What the guard does inside vLLM's ``BlockPool``: the wrappers the patch table installs
on the class itself, its state, and the check of a pool a guard attaches to.

The wrappers sit on vLLM's ``BlockPool`` class (``patches.PATCHES``), so every pool runs
them: vLLM's own, and a subclass built elsewhere as long as its overrides call
``BlockPool``'s (kvcached's ``ElasticBlockPool`` does, for every registration:
:func:`check_pool`). No pool is re-classed or rebuilt, so none loses CPython's inline
attribute storage (re-classing one costs +1.5% instructions per scheduler step at 256
running) or its identity (vLLM 0.34's blocks hold a weak reference to their pool).

Until a scheduler's guard attaches (:func:`attach`), the class-level defaults of
:class:`PoolState` say no step is open, and every wrapper passes straight through.

Each hot wrapper takes vLLM's exact parameters (the table's, checked on vLLM's method at
start-up and on the wrapper by ``tests/test_patches.py``) and calls vLLM's function
directly: one plain frame per call.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Callable
from typing import Any

from vllm_prefix_guard import kvcached_support, targets
from vllm_prefix_guard.patches import BLOCK_POOL, PATCHES

AnyFn = Callable[..., Any]


class PoolState:
    """Class-level defaults the table adds to ``BlockPool`` (:func:`attach` gives a pool
    its own values)."""

    #: The open step's record (``StepCacheEntries``); None: no step open.
    uncommitted_entries: Any = None
    #: (request ID, group) of loaders rewound below blocks that kept their entry.
    kept_block_owners: Any = frozenset()
    #: The request whose ``cache_*_block`` call is running; None for pool-driven moves
    #: (a copy-on-write move of a Mamba checkpoint).
    _guard_request_id: str | None = None
    #: KV events are published and a guard is attached: events name hashes, not blocks.
    _guard_events = False
    #: ``(num_tokens, first copy)`` of each block the running ``cache_*`` call inserts,
    #: while ``_guard_events``.
    _guard_copies: list[tuple[int, bool]] | None = None
    #: A scheduler's guard attached to the pool (:func:`attach`).
    guard_attached = False
    #: Entries recorded; entries removed that were still cached, and that were not.
    registrations_tracked = 0
    guard_removed = 0
    stale_entries_skipped = 0


def attach(pool: Any) -> Any:
    """Give ``pool`` its own state (a guard attaches to it); returns ``pool``.

    Raises:
        GuardUnsupportedError: the pool is one the guard cannot follow (:func:`check_pool`).
    """
    check_pool(pool)
    # Attributes only, never ``vars(pool)``: on CPython 3.11 reading an object's
    # ``__dict__`` moves its inline attributes into a dict for good, and every later
    # attribute access of vLLM's to the pool gets slower.
    if not pool.guard_attached:
        pool.uncommitted_entries = None
        pool.kept_block_owners = set()
        pool.registrations_tracked = pool.guard_removed = pool.stale_entries_skipped = 0
        pool._guard_events = bool(pool.enable_kv_cache_events)
        pool.guard_attached = True
    return pool


def check_pool(pool: Any) -> None:
    """Refuse a pool (or pool class) the wrappers would not see every registration of: one
    that lacks what they use, or overrides a wrapped method without calling it.

    Raises:
        GuardUnsupportedError: naming what is missing, and kvcached's variants where it is
            kvcached's pool.
    """
    cls = pool if isinstance(pool, type) else type(pool)
    missing = missing_pool_internals(pool)
    if not missing:
        missing = [f"{n} calling BlockPool's" for n in overrides_not_calling(cls)]
    if missing:
        raise targets.unsupported(
            f"the KV-cache block pool {cls.__module__}.{cls.__qualname__}",
            f"has no {', '.join(missing)}",
            kvcached_support.refusal_hint(cls),
        )


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


def overrides_not_calling(cls: type) -> list[str]:
    """Wrapped ``BlockPool`` methods that ``cls`` resolves to an override of a class above
    vLLM's, which does not call a method of that name (read from its source):
    registrations there would not reach the wrapper. A class that is no ``BlockPool``
    never reaches the wrappers at all: every wrapped name."""
    vllm_pool = targets.resolve(BLOCK_POOL, "BlockPool")
    names = [p.name for p in PATCHES if p.module == BLOCK_POOL and p.name is not None]
    if vllm_pool not in cls.__mro__:
        return names
    escaping = []
    for name in names:
        owner = next(k for k in cls.__mro__ if name in vars(k) or k is vllm_pool)
        if owner is vllm_pool:
            continue
        tree = targets.function_tree(inspect.unwrap(vars(owner)[name]))
        if tree is None or not any(
            isinstance(node, ast.Call) and getattr(node.func, "attr", None) == name
            for node in ast.walk(tree)
        ):
            escaping.append(name)
    return escaping


# -- the wrappers (each takes vLLM's function and returns the replacement) -------------


def wrap_cache_full_blocks(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def cache_full_blocks(
        self: Any,
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
        if self._guard_events:
            return cache_full_blocks_with_events(
                self,
                original,
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
            return original(
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

    return cache_full_blocks


def cache_full_blocks_with_events(
    pool: Any,
    original: AnyFn,
    request: Any,
    blocks: Any,
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    kv_cache_group_id: int,
    block_mask: Any,
) -> Any:
    """``cache_full_blocks`` with KV events on: the call's ``BlockStored`` names only the
    blocks that are their hash's first copy. Apart, so that the events-off path (the
    common one) pays none of it."""
    queue = pool.kv_event_queue
    queued, pool._guard_copies = len(queue), []
    pool._guard_request_id = request.request_id
    try:
        result = original(
            pool,
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        )
    finally:
        pool._guard_request_id = None
        copies, pool._guard_copies = pool._guard_copies, None
    if len(queue) > queued:
        store_first_copies(pool, queue, copies, num_cached_blocks, block_size)
    return result


def store_first_copies(
    pool: Any, queue: list[Any], copies: Any, num_cached_blocks: int, block_size: int
) -> None:
    """Rewrite the ``BlockStored`` a ``cache_*`` call queued last so that it names only
    the blocks that are their hash's first copy (the series' part 3); ``copies`` as
    :attr:`PoolState._guard_copies` holds them."""
    if not copies or all(first for _, first in copies):
        return
    if type(queue[-1]).__name__ != "BlockStored":
        return
    stored = queue.pop()
    positions = [(n // block_size - 1 - num_cached_blocks, first) for n, first in copies]
    queue.extend(pool.first_copy_events(stored, positions))


def wrap_cache_partial_block(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def cache_partial_block(
        self: Any,
        request: Any,
        block: Any,
        num_tokens: int,
        kv_cache_group_id: int,
        block_size: int,
        replace_existing_hashes: bool = False,
    ) -> Any:
        queue = self.kv_event_queue if self._guard_events else None
        if queue is not None:
            queued, self._guard_copies = len(queue), []
        self._guard_request_id = request.request_id
        try:
            result = original(
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
            if queue is not None:
                copies, self._guard_copies = self._guard_copies, None
        if (
            queue is not None
            and copies
            and not copies[-1][1]
            and len(queue) > queued
            and type(queue[-1]).__name__ == "BlockStored"
        ):
            queue.pop()  # its one BlockStored: another block caches the hash
        return result

    return cache_partial_block


def wrap_insert_block_hash(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def _insert_block_hash(
        self: Any, block_hash_with_group_id: Any, block: Any, num_tokens: int | None
    ) -> Any:
        entries = self.uncommitted_entries
        copies = self._guard_copies
        if entries is None and copies is None:
            return original(self, block_hash_with_group_id, block, num_tokens)
        if copies is not None:
            first = self.cached_block_hash_to_block.get_one_block(block_hash_with_group_id)
            copies.append((num_tokens or 0, first is None))
        # Whether vLLM made an entry is read from what it did: a block without a hash
        # got this one as its primary, a hashed block one more secondary hash.
        if block.block_hash is None:
            result = original(self, block_hash_with_group_id, block, num_tokens)
            if block.block_hash is None or entries is None:
                return result
        else:
            secondary = self.cached_block_hashes_by_block.get(block.block_id)
            known = len(secondary) if secondary else 0
            result = original(self, block_hash_with_group_id, block, num_tokens)
            secondary = self.cached_block_hashes_by_block.get(block.block_id)
            if secondary is None or len(secondary) == known or entries is None:
                return result
        # num_tokens: the prefix length the key names (which tokens' KV it must hold).
        entry = (block_hash_with_group_id, block, num_tokens)
        request_entries = entries.get(self._guard_request_id)
        if request_entries is None:
            entries[self._guard_request_id] = [entry]
        else:
            request_entries.append(entry)
        self.registrations_tracked += 1
        return result

    return _insert_block_hash


def wrap_emit_block_removed_events(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def _emit_block_removed_events(self: Any, block_hashes: Any) -> Any:
        # A hash another block still caches is not removed (the series' part 3).
        if block_hashes and self._guard_events:
            block_hashes = self.uncached_block_hashes(block_hashes)
        return original(self, block_hashes)

    return _emit_block_removed_events


def wrap_remove_uncommitted_entry(original: AnyFn) -> AnyFn:
    native_evict_blocks = targets.resolve(targets.BLOCK_POOL, "BlockPool").evict_blocks

    @functools.wraps(original)
    def remove_uncommitted_entry(self: Any, entry: Any) -> bool:
        key, block, _ = entry
        if (
            block.block_hash is key
            and block.ref_cnt == 0
            and type(self).evict_blocks is not native_evict_blocks
        ):
            # The pool's own evict_blocks frees more than hashes (kvcached's returns the
            # block's pages): an undone block nobody holds goes through it.
            self.evict_blocks({block.block_id})
            removed = True
        else:
            removed = original(self, entry)
        if removed:
            self.guard_removed += 1
        else:
            self.stale_entries_skipped += 1
        return removed

    return remove_uncommitted_entry
