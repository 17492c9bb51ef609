"""What the guard does inside vLLM's ``BlockPool``: the wrappers the patch table installs
on the class itself, its state, and the check of a pool a guard attaches to.

The wrappers sit on vLLM's ``BlockPool`` class (``patches.PATCHES``), so every pool runs
them: vLLM's own, and a subclass built elsewhere as long as its overrides call
``BlockPool``'s (kvcached's ``ElasticBlockPool`` does, for every registration:
:func:`check_pool`). No pool is re-classed or rebuilt, so none loses CPython's inline
attribute storage (re-classing one costs +1.5% instructions per scheduler step at 256
running) or its identity (vLLM 0.34's blocks hold a weak reference to their pool).

Until a scheduler's guard attaches (:func:`attach`), the class-level defaults of
:class:`PoolState` say no step is open and KV events are not rewritten: the wrappers
record nothing.

Each hot wrapper takes vLLM's exact parameters (the table's, checked on vLLM's method at
start-up and on the wrapper by ``tests/unit/test_patches.py``) and calls vLLM's function
directly: one plain frame per call.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
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
    #: KV events are published and a guard is attached: events name hashes, not blocks.
    _guard_events = False
    #: A scheduler's guard attached to the pool (:func:`attach`).
    guard_attached = False
    #: Entries removed that were still cached, and that were not (the scheduler's guard
    #: counts those recorded, per step).
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
        pool.guard_removed = pool.stale_entries_skipped = 0
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
#
# Each registering method is wrapped, not ``_insert_block_hash`` (one frame less per
# registration): a wrapper reads which entries vLLM made from what its call changed, so
# no test of vLLM's is copied. Only vLLM's offloading tier calls ``_insert_block_hash``
# directly, on its own CPU pool, which no guard attaches to (tests/unit/test_targets.py pins
# the callers on each tested release).
#
# The hot path (a step records, the call fills one block: most of a decode step's calls)
# costs one tuple and no Python frame besides the wrapper's own; the scheduler's guard
# counts the entries per step (``SchedulerGuard.end_step``), not per call.


def block_hash_getter() -> AnyFn:
    """``block.block_hash`` as a C call: on the field behind vLLM's property where the
    property returns it (0.30-0.33: a Python frame per read, two per registration
    here), else the attribute itself (0.34 made it a plain field)."""
    probe = targets.resolve(targets.KV_CACHE_UTILS, "KVCacheBlock")(0)
    try:
        probe._block_hash = marker = object()
    except AttributeError:  # slots, and no such field
        return operator.attrgetter("block_hash")
    return operator.attrgetter("_block_hash" if probe.block_hash is marker else "block_hash")


def wrap_cache_full_blocks(original: AnyFn) -> AnyFn:
    block_hash = block_hash_getter()

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
            request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        ):  # fmt: skip
            return None  # blocks a failed load's rollback kept (the series' part 2)
        entries = self.uncommitted_entries
        if num_cached_blocks >= num_full_blocks or (entries is None and not self._guard_events):
            return original(
                self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
                kv_cache_group_id, block_mask,
            )  # fmt: skip
        if num_full_blocks - num_cached_blocks != 1 or self._guard_events:
            return cache_and_record_full_blocks(
                original, block_hash, self, request, blocks, num_cached_blocks, num_full_blocks,
                block_size, kv_cache_group_id, block_mask,
            )  # fmt: skip
        # One block filled (a decode step's usual call): the same, unrolled.
        block = blocks[num_cached_blocks]
        before = block_hash(block)
        result = original(
            self, request, blocks, num_cached_blocks, num_full_blocks, block_size,
            kv_cache_group_id, block_mask,
        )  # fmt: skip
        key = block_hash(block)
        if key is not before and key is not None:
            entries.setdefault(request.request_id, []).append(
                (key, block, num_full_blocks * block_size)
            )
        return result

    return cache_full_blocks


def cache_and_record_full_blocks(
    original: AnyFn,
    block_hash: AnyFn,
    pool: Any,
    request: Any,
    blocks: Any,
    num_cached_blocks: int,
    num_full_blocks: int,
    block_size: int,
    kv_cache_group_id: int,
    block_mask: Any,
) -> Any:
    """Call vLLM's ``cache_full_blocks`` and record the entries it made.

    A block vLLM gave a new primary hash is a new entry (a full block has no other);
    null and masked blocks keep theirs. The entries, (hash, block, number of tokens the
    hash names), are built per block in C.
    """
    new_blocks = blocks[num_cached_blocks:num_full_blocks]
    hashes_before = list(map(block_hash, new_blocks))
    queued = len(pool.kv_event_queue) if pool._guard_events else 0
    result = original(
        pool, request, blocks, num_cached_blocks, num_full_blocks, block_size,
        kv_cache_group_id, block_mask,
    )  # fmt: skip
    hashes = list(map(block_hash, new_blocks))
    tokens = range(
        (num_cached_blocks + 1) * block_size, num_full_blocks * block_size + 1, block_size
    )
    new = list(zip(hashes, new_blocks, tokens, strict=True))
    if None in hashes or True in map(operator.is_, hashes, hashes_before):
        new = [
            entry
            for entry, before in zip(new, hashes_before, strict=True)
            if entry[0] is not None and entry[0] is not before
        ]
    if new:
        record_entries(pool, request.request_id, new)
        if pool._guard_events:
            store_first_copies(pool, queued, new, num_cached_blocks, block_size)
    return result


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
        # Rare (hybrid models' state blocks): read what the call changed on every pool.
        primary = block.block_hash
        known = len(self.cached_block_hashes_by_block.get(block.block_id, ()))
        queued = len(self.kv_event_queue) if self._guard_events else 0
        key = original(
            self,
            request,
            block,
            num_tokens,
            kv_cache_group_id,
            block_size,
            replace_existing_hashes,
        )
        # A new entry made the key the block's primary hash, or one more secondary.
        if key is not None and (
            block.block_hash is not primary
            or len(self.cached_block_hashes_by_block.get(block.block_id, ())) > known
        ):
            new = [(key, block, num_tokens)]
            record_entries(self, request.request_id, new)
            if self._guard_events:
                store_first_copies(self, queued, new, 0, num_tokens)
        return key

    return cache_partial_block


def wrap_move_block_hashes(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def move_block_hashes(self: Any, src_block: Any, dst_block: Any) -> Any:
        result = original(self, src_block, dst_block)
        # The copy is written by the step being scheduled: its entries are that step's,
        # on no request's behalf.
        if self.uncommitted_entries is not None and dst_block.block_hash is not None:
            num_tokens = dst_block.block_hash_num_tokens
            moved = [
                dst_block.block_hash,
                *self.cached_block_hashes_by_block.get(dst_block.block_id, ()),
            ]
            record_entries(self, None, [(key, dst_block, num_tokens) for key in moved])
        return result

    return move_block_hashes


def record_entries(pool: Any, request_id: str | None, new: list[Any]) -> None:
    """Put the entries one call made into the open step's record, if a step is open."""
    entries = pool.uncommitted_entries
    if entries is not None:
        entries.setdefault(request_id, []).extend(new)


def store_first_copies(
    pool: Any, queued: int, new: list[Any], num_cached_blocks: int, block_size: int
) -> None:
    """Rewrite the ``BlockStored`` the ``cache_*`` call queued last (past ``queued``
    events) so that it names only the blocks that are their hash's first copy (the
    series' part 3): the block the index yields for the hash.

    Args:
        new: The call's entries, one per hash of the event, in its order.
        num_cached_blocks: The call's; a block's position in the event is its entry's
            number of tokens in ``block_size`` blocks past these (a partial block: 0, 0
            and its number of tokens).
    """
    queue = pool.kv_event_queue
    if len(queue) <= queued or type(queue[-1]).__name__ != "BlockStored":
        return
    get_one_block = pool.cached_block_hash_to_block.get_one_block
    copies = [
        (num_tokens // block_size - 1 - num_cached_blocks, get_one_block(key) is block)
        for key, block, num_tokens in new
    ]
    if all(first for _, first in copies):
        return
    queue.extend(pool.first_copy_events(queue.pop(), copies))


def wrap_emit_block_removed_events(original: AnyFn) -> AnyFn:
    @functools.wraps(original)
    def _emit_block_removed_events(self: Any, block_hashes: Any) -> Any:
        # A hash another block still caches is not removed (the series' part 3).
        if self._guard_events and block_hashes:
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
