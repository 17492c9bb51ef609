"""A mixin grafted onto the scheduler's live ``BlockPool`` to record and undo registrations.

vLLM's ``BlockHashToBlockMap`` already keeps every physical block registered under a
key (``key -> {block_id: block}``): concurrent requests that materialise the same prefix
each own a block under the same ``(block_hash, group_id)``. The mixin keeps that
multi-block index as the single source of truth and adds two things on top:

- *recording*: while the ledger has a step open, every ``(key, block)`` pair that
  ``_insert_block_hash`` newly adds is appended to that step's bucket, attributed to
  the request whose ``cache_full_blocks``/``cache_partial_block`` call made it;
- *exact undo*: :meth:`PrefixGuardPool.guard_unregister` removes one recorded pair,
  never a sibling block under the same key, and only if the block still holds the
  registration it had when recorded (it may have been evicted and reused since).

The mixin is grafted onto the instance (``pool.__class__`` swap), whatever class vLLM or
kvcached built, so it relies on no constructor: state is set up by :func:`graft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    _PoolBase = Any
else:
    _PoolBase = object

#: Pool internals the mixin relies on; :func:`graft` refuses a pool that lacks one.
REQUIRED_POOL_ATTRS = (
    "cache_full_blocks",
    "cache_partial_block",
    "move_block_hashes",
    "reset_prefix_cache",
    "_insert_block_hash",
    "_remove_cached_block_hashes",
    "_emit_block_removed_events",
    "cached_block_hash_to_block",
    "cached_block_hashes_by_block",
)


class GuardUnsupportedError(RuntimeError):
    """The installed vLLM (or a pool replacing vLLM's) lacks an internal the guard needs."""


class RegistrationSink(Protocol):
    """Where the pool reports speculative registrations (the ledger's open bucket)."""

    def record(self, request_id: str | None, key: Any, block: Any, generation: int) -> None: ...


class PrefixGuardPool(_PoolBase):
    """Cooperative mixin: every override calls ``super()`` and passes arguments through."""

    # Set by the ledger while a step is open; None means "do not record".
    _guard_sink: RegistrationSink | None
    # Request whose cache_*_block call is running; None for pool-driven moves (Mamba CoW).
    _guard_request_id: str | None
    # Bumped whenever a block loses its hashes, so old records can tell it was reused.
    _guard_generation: dict[int, int]
    # Bumped on every successful reset_prefix_cache (which drops all hashes at once).
    guard_epoch: int

    def _guard_init_state(self) -> None:
        self._guard_sink = None
        self._guard_request_id = None
        self._guard_generation = {}
        self.guard_epoch = 0

    # -- recording -------------------------------------------------------------------

    def cache_full_blocks(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self._guard_sink is None:
            return super().cache_full_blocks(request, *args, **kwargs)
        self._guard_request_id = request.request_id
        try:
            return super().cache_full_blocks(request, *args, **kwargs)
        finally:
            self._guard_request_id = None

    def cache_partial_block(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        if self._guard_sink is None:
            return super().cache_partial_block(request, *args, **kwargs)
        self._guard_request_id = request.request_id
        try:
            return super().cache_partial_block(request, *args, **kwargs)
        finally:
            self._guard_request_id = None

    def _insert_block_hash(self, key: Any, block: Any, *args: Any, **kwargs: Any) -> Any:
        sink = self._guard_sink
        if (
            sink is None
            or block.block_hash == key
            or self.cached_block_hash_to_block.contain(key, block.block_id)
        ):
            # Not recording, or not a new (key, block) pair: nothing to undo later.
            return super()._insert_block_hash(key, block, *args, **kwargs)
        result = super()._insert_block_hash(key, block, *args, **kwargs)
        sink.record(
            self._guard_request_id, key, block, self._guard_generation.get(block.block_id, 0)
        )
        return result

    def _remove_cached_block_hashes(self, block: Any, *args: Any, **kwargs: Any) -> Any:
        removed = super()._remove_cached_block_hashes(block, *args, **kwargs)
        if removed:
            generation = self._guard_generation
            generation[block.block_id] = generation.get(block.block_id, 0) + 1
        return removed

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        reset = super().reset_prefix_cache(*args, **kwargs)
        if reset:
            self.guard_epoch += 1
        return reset

    # -- undo ------------------------------------------------------------------------

    def guard_unregister(self, key: Any, block: Any, generation: int) -> bool:
        """Remove the recorded registration ``(key, block.block_id)``; emit ``BlockRemoved``.

        A primary key takes the block's secondary (partial) keys with it: those were
        added on top of the same not-yet-written content. Sibling blocks under ``key``
        are never touched.

        Returns:
            False if the record is stale (the block lost its hashes since it was
            recorded, e.g. evicted and reused) or the pair is already gone.
        """
        block_id = block.block_id
        if self._guard_generation.get(block_id, 0) != generation:
            return False
        if block.block_hash == key:
            removed = self._remove_cached_block_hashes(block)
        elif self.cached_block_hash_to_block.pop(key, block_id) is not None:
            secondary = self.cached_block_hashes_by_block.get(block_id)
            if secondary is not None:
                secondary.discard(key)
                if not secondary:
                    del self.cached_block_hashes_by_block[block_id]
            removed = [key]
        else:
            return False
        self._emit_block_removed_events(removed)
        return bool(removed)


_GUARDED_CLASSES: dict[type, type] = {}


def graft(pool: Any) -> Any:
    """Make ``pool`` a :class:`PrefixGuardPool` in place (identity preserved); idempotent.

    One guarded class is built per base class, so ``type(pool).__mro__`` reads
    ``PrefixGuarded<Base> -> PrefixGuardPool -> <Base> -> ...``.

    Raises:
        GuardUnsupportedError: the pool lacks an internal the guard relies on.
    """
    if isinstance(pool, PrefixGuardPool):
        return pool
    base = type(pool)
    missing = [name for name in REQUIRED_POOL_ATTRS if not hasattr(pool, name)]
    if missing:
        raise GuardUnsupportedError(
            f"vllm-prefix-guard cannot guard {base.__module__}.{base.__qualname__}: it has no "
            f"{', '.join(missing)}. Disable the guard with VLLM_PREFIX_GUARD=0."
        )
    guarded = _GUARDED_CLASSES.get(base)
    if guarded is None:
        guarded = type(
            f"PrefixGuarded{base.__name__}", (PrefixGuardPool, base), {"__module__": __name__}
        )
        _GUARDED_CLASSES[base] = guarded
    pool.__class__ = guarded
    pool._guard_init_state()
    return pool
