"""A mixin grafted onto the scheduler's live ``BlockPool`` to record and undo registrations.

vLLM's ``BlockHashToBlockMap`` already keeps every physical block registered under a
key (``key -> {block_id: block}``): concurrent requests that materialise the same prefix
each own a block under the same ``(block_hash, group_id)``. The mixin keeps that
multi-block index as the single source of truth and adds two things on top:

- *recording*: while a sink is set (:meth:`PrefixGuardPool.guard_record_into`, the
  ledger's open step), every ``(key, block)`` pair that ``_insert_block_hash`` newly adds
  is handed to it, attributed to the request whose ``cache_full_blocks`` /
  ``cache_partial_block`` call made it, with the prefix length the key names;
- *exact undo*: :meth:`PrefixGuardPool.guard_unregister` removes one recorded pair,
  never a sibling block under the same key, and only if the block still holds that very
  registration. vLLM builds a new key object for every registration, so identity (not
  equality) tells a recorded registration from a later one of equal content: a block
  evicted and re-registered since has an equal key, but not the same object.

The mixin is grafted onto the instance (:func:`graft`), whatever class vLLM or kvcached
built, so it relies on no constructor: :func:`graft` sets its state up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from vllm_prefix_guard import kvcached_support, targets

if TYPE_CHECKING:
    _PoolBase = Any
else:
    _PoolBase = object


class RegistrationSink(Protocol):
    """Where the pool reports the registrations of a step (the ledger's open bucket)."""

    def record(
        self, request_id: str | None, key: Any, block: Any, num_tokens: int | None = None
    ) -> None: ...


class PrefixGuardPool(_PoolBase):
    """Cooperative mixin: every override calls ``super()`` and passes arguments through."""

    # None: do not record (no step open, or a confirmed registration path).
    _guard_sink: RegistrationSink | None
    # Request whose cache_*_block call is running; None for pool-driven moves (Mamba CoW).
    _guard_request_id: str | None
    # Bumped on every successful reset_prefix_cache (which drops all hashes at once).
    guard_epoch: int
    # The pool's own evict_blocks does more than drop hashes (kvcached's returns the
    # block's physical pages): an undone block nobody holds is evicted through it.
    _guard_evict_releases: bool

    def _guard_init_state(self) -> None:
        self._guard_sink = None
        self._guard_request_id = None
        self.guard_epoch = 0
        native = targets.resolve(targets.BLOCK_POOL, "BlockPool").evict_blocks
        self._guard_evict_releases = type(self).evict_blocks is not native

    # -- recording -------------------------------------------------------------------

    def guard_record_into(self, sink: RegistrationSink | None) -> RegistrationSink | None:
        """Hand every new registration to ``sink`` from now on (None: stop recording).

        Returns:
            The sink that was set before, so a caller can pause and resume recording.
        """
        previous = self._guard_sink
        self._guard_sink = sink
        return previous

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
        # vLLM's own test for "already registered" (equality), asked before it acts: an
        # unhashed block is in no entry yet (every removal path clears all of its keys).
        is_new = block.block_hash is None or (
            block.block_hash != key
            and not self.cached_block_hash_to_block.contain(key, block.block_id)
        )
        result = super()._insert_block_hash(key, block, *args, **kwargs)
        if is_new:
            # The prefix length the key names: which tokens' KV the block must hold.
            num_tokens = kwargs.get("num_tokens", args[0] if args else None)
            sink.record(self._guard_request_id, key, block, num_tokens)
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
        added after it, on top of the same not-yet-written content. Sibling blocks under
        ``key`` are never touched.

        Returns:
            False if the record is stale (the block no longer holds this registration:
            evicted, possibly re-registered with an equal key since) or already undone.
        """
        if block.block_hash is key:
            if block.ref_cnt == 0 and self._guard_evict_releases:
                self.evict_blocks({block.block_id})
                return True
            removed = self._remove_cached_block_hashes(block)
        else:
            block_id = block.block_id
            secondary = self.cached_block_hashes_by_block.get(block_id)
            # Set membership is by equality; the recorded registration is this object.
            if not secondary or not any(held is key for held in secondary):
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
    missing = missing_pool_internals(pool)
    if missing:
        raise targets.unsupported(
            f"the KV-cache block pool {base.__module__}.{base.__qualname__}",
            f"has no {', '.join(missing)}",
            kvcached_support.refusal_hint(base),
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
