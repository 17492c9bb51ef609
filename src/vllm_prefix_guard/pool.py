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
  registration it had when recorded (it may have been evicted and reused since: vLLM
  builds a new key object for every registration, so identity tells them apart).

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

    def record(self, request_id: str | None, key: Any, block: Any) -> None: ...


class PrefixGuardPool(_PoolBase):
    """Cooperative mixin: every override calls ``super()`` and passes arguments through."""

    # Set by the ledger while a step is open; None means "do not record".
    _guard_sink: RegistrationSink | None
    # Request whose cache_*_block call is running; None for pool-driven moves (Mamba CoW).
    _guard_request_id: str | None
    # Bumped on every successful reset_prefix_cache (which drops all hashes at once).
    guard_epoch: int

    def _guard_init_state(self) -> None:
        self._guard_sink = None
        self._guard_request_id = None
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
        if sink is None:
            return super()._insert_block_hash(key, block, *args, **kwargs)
        # An unhashed block is in no entry yet (every removal path clears all of a
        # block's keys), so the pair is new; otherwise ask, as vLLM is about to.
        is_new = block.block_hash is None or (
            block.block_hash != key
            and not self.cached_block_hash_to_block.contain(key, block.block_id)
        )
        result = super()._insert_block_hash(key, block, *args, **kwargs)
        if is_new:
            sink.record(self._guard_request_id, key, block)
        return result

    def reset_prefix_cache(self, *args: Any, **kwargs: Any) -> Any:
        reset = super().reset_prefix_cache(*args, **kwargs)
        if reset:
            self.guard_epoch += 1
        return reset

    # -- undo ------------------------------------------------------------------------

    def guard_unregister(self, key: Any, block: Any) -> bool:
        """Remove the recorded registration ``(key, block.block_id)``; emit ``BlockRemoved``.

        A primary key takes the block's secondary (partial) keys with it: those were
        added on top of the same not-yet-written content. Sibling blocks under ``key``
        are never touched.

        Returns:
            False if the record is stale (the block lost that registration since it was
            recorded, e.g. evicted and reused) or the pair is already gone.
        """
        block_id = block.block_id
        if block.block_hash is key:
            removed = self._remove_cached_block_hashes(block)
        else:
            secondary = self.cached_block_hashes_by_block.get(block_id)
            if not secondary or key not in secondary:
                return False
            if self.cached_block_hash_to_block.pop(key, block_id) is None:
                return False
            secondary.discard(key)
            if not secondary:
                del self.cached_block_hashes_by_block[block_id]
            removed = [key]
        self._emit_block_removed_events(removed)
        return bool(removed)


_GUARDED_CLASSES: dict[type, type] = {}


def graft(pool: Any, fresh: bool = False) -> Any:
    """Make ``pool`` a :class:`PrefixGuardPool`; idempotent; returns the guarded pool.

    One guarded class is built per base class, so ``type(pool).__mro__`` reads
    ``PrefixGuarded<Base> -> PrefixGuardPool -> <Base> -> ...``.

    Args:
        pool: the pool vLLM (or kvcached) built.
        fresh: ``pool`` was just constructed and only its own blocks refer to it (vLLM's
            coordinator assigning the pool it built). It is then moved into the guarded
            class as a new object, attributes copied in order and blocks re-pointed:
            CPython 3.11 turns an object's inline attributes into a dict when its
            ``__class__`` is reassigned, which slows every later access (measured: about
            1% of a scheduler step). Otherwise (a pool others already share, e.g.
            kvcached's replacement) the class is swapped in place, identity preserved.

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
    blocks = getattr(pool, "blocks", None)
    if fresh and blocks is not None:
        moved: Any = object.__new__(guarded)
        for name, value in vars(pool).items():
            object.__setattr__(moved, name, value)
        for block in blocks:
            if getattr(block, "pool", None) is pool:
                block.pool = moved
        pool = moved
    else:
        pool.__class__ = guarded
    pool._guard_init_state()
    return pool
