"""The step ledger: which speculative registrations each scheduler step made, until it commits.

One bucket per ``schedule()`` call. While the call runs the bucket is *open*: the pool
records into it every ``(key, block)`` pair that ``allocate_slots`` newly registers. When
``schedule()`` returns, the bucket is *dispatched*, keyed by the identity of the
``SchedulerOutput`` it produced (not by a counter, so dropped or foreign outputs cannot
shift the pairing). ``update_from_output`` for that output *commits* it, after the
step's KV-load failures were rolled back.

Rollback rules (why each exists is in the README's design section):

- preemption inside ``schedule()`` rolls back the victim's entries in the open bucket
  only: dispatched steps cannot be cancelled and will write their blocks (the
  :class:`PreemptionScope` policy can widen this, to measure what that costs);
- a KV-load failure rolls back, in the failing step, each affected request's entries
  from its first invalid block on, and that request's entries in later in-flight steps
  (computed on top of the invalid KV);
- a dispatched step that never comes back (its successor commits first) is rolled back
  whole; ``reset_prefix_cache`` drops every bucket.

The ledger owns what the scheduler hooks need to resolve after a rollback: blocks rolled
back while another request held them (*contested*), and the keys of failed loads.

Cost: O(1) per step plus O(1) per recorded registration; rollback is O(entries undone).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from vllm_prefix_guard.pool import PrefixGuardPool
from vllm_prefix_guard.stats import GuardStats

# (key, block) as recorded by the pool.
Entry = tuple[Any, Any]


class StepBucket:
    """The registrations of one scheduler step, grouped by the request that made them.

    Entries of ``None`` were made on no request's behalf (Mamba copy-on-write moves:
    the copy runs even if the request is preempted, so only a dropped step undoes them).
    """

    __slots__ = ("by_request", "size")

    def __init__(self) -> None:
        self.by_request: dict[str | None, list[Entry]] = {}
        self.size = 0

    def record(self, request_id: str | None, key: Any, block: Any) -> None:
        entries = self.by_request.get(request_id)
        if entries is None:
            self.by_request[request_id] = [(key, block)]
        else:
            entries.append((key, block))
        self.size += 1

    def pop_request(self, request_id: str) -> list[Entry]:
        """Take all of ``request_id``'s entries out of the bucket."""
        entries = self.by_request.pop(request_id, None) or []
        self.size -= len(entries)
        return entries

    def pop_request_from(self, request_id: str, first: int) -> list[Entry]:
        """Take ``request_id``'s entries from index ``first`` on out of the bucket."""
        entries = self.by_request.get(request_id)
        if not entries:
            return []
        taken = entries[first:]
        del entries[first:]
        self.size -= len(taken)
        return taken

    def pop_all(self) -> list[Entry]:
        """Take every entry out of the bucket."""
        entries = [entry for request in self.by_request.values() for entry in request]
        self.by_request.clear()
        self.size = 0
        return entries


class PreemptionScope(Protocol):
    """How far a preemption reaches beyond the open step.

    The guard's rule is the open step only (``None``). A policy given to the ledger is
    called after that, once per victim, and may undo (or merely unregister) the victim's
    entries in steps already in flight, through the ledger's public API.
    """

    def after_open_step_rollback(self, ledger: StepLedger, request_id: str) -> None: ...


class StepLedger:
    """Per-scheduler FIFO of uncommitted registration buckets over one guarded pool."""

    def __init__(self, pool: PrefixGuardPool, preemption_scope: PreemptionScope | None = None):
        self.pool = pool
        self.stats = GuardStats()
        self.preemption_scope = preemption_scope
        self.open: StepBucket | None = None
        # id(SchedulerOutput) -> (output, bucket), in dispatch order. The output is held
        # so its id cannot be reused while the step is in flight.
        self._dispatched: dict[int, tuple[object, StepBucket]] = {}
        # Blocks rolled back in the open step while another request still held them.
        self._contested_blocks: set[int] = set()
        # Keys of the entries failed-load rollbacks removed, until a hook takes them.
        self._failed_keys: set[Any] = set()
        self._epoch = pool.guard_epoch

    # -- step lifecycle --------------------------------------------------------------

    @property
    def steps_in_flight(self) -> int:
        return len(self._dispatched)

    @property
    def uncommitted_entries(self) -> int:
        """Entries of steps dispatched but not committed (O(steps in flight)). Safe to read
        from another thread: the buckets are listed in one step under the GIL."""
        return sum(bucket.size for _, bucket in list(self._dispatched.values()))

    @property
    def is_idle(self) -> bool:
        """No open step, no step in flight, nothing uncommitted."""
        return self.open is None and not self._dispatched

    def counters(self) -> dict[str, int]:
        """The stats plus the entries uncommitted right now, as operators read them."""
        return {**self.stats.as_dict(), "uncommitted_entries": self.uncommitted_entries}

    def begin_step(self) -> None:
        """Open the bucket of a ``schedule()`` call; the pool records into it."""
        self.sync_with_pool()
        bucket = StepBucket()
        self.open = bucket
        self._contested_blocks.clear()
        self.pool.guard_record_into(bucket)

    def dispatch_step(self, output: object) -> None:
        """Close the open bucket and tie it to the ``SchedulerOutput`` it belongs to."""
        bucket = self.open
        assert bucket is not None, "dispatch_step without begin_step"
        self.open = None
        self.pool.guard_record_into(None)
        self._dispatched[id(output)] = (output, bucket)
        if bucket.size:
            stats = self.stats
            stats.registrations_tracked += bucket.size
            uncommitted = self.uncommitted_entries
            if uncommitted > stats.peak_uncommitted_entries:
                stats.peak_uncommitted_entries = uncommitted

    def abandon_step(self) -> None:
        """``schedule()`` raised: its step will never run, so undo what it registered."""
        bucket = self.open
        self.open = None
        self.pool.guard_record_into(None)
        self._contested_blocks.clear()
        if bucket is not None:
            self.stats.rolled_back_dropped_step += self.unregister(bucket.pop_all())

    def commit_step(self, output: object) -> None:
        """The step of ``output`` came back: its registrations are written. Older steps
        still queued never will be (their outputs were dropped), so they are undone."""
        key = id(output)
        if key not in self._dispatched:
            return  # not a step of ours, e.g. a fault-tolerance drain's empty output
        dispatched = self._dispatched
        while True:
            oldest = next(iter(dispatched))
            _, bucket = dispatched.pop(oldest)
            if oldest == key:
                self.stats.steps_committed += 1
                return
            self.stats.rolled_back_dropped_step += self.unregister(bucket.pop_all())

    def clear(self) -> None:
        """Forget every bucket: the pool's hashes were all reset."""
        self._dispatched.clear()
        if self.open is not None:
            self.open = StepBucket()
            self.pool.guard_record_into(self.open)
        self._contested_blocks.clear()
        self._failed_keys.clear()
        self._epoch = self.pool.guard_epoch

    def sync_with_pool(self) -> None:
        """Forget every bucket if the pool reset its prefix cache since the last look."""
        if self.pool.guard_epoch != self._epoch:
            self.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop recording, for confirmed registrations made inside ``schedule()``."""
        sink = self.pool.guard_record_into(None)
        try:
            yield
        finally:
            self.pool.guard_record_into(sink)

    # -- steps in flight -------------------------------------------------------------

    def in_flight_buckets(self) -> Iterator[StepBucket]:
        """Buckets of the steps dispatched and not yet committed, oldest first."""
        for _, bucket in self._dispatched.values():
            yield bucket

    def _buckets_from(self, output: object) -> Iterator[StepBucket]:
        """The bucket of ``output``'s step and of every step dispatched after it."""
        found = False
        for key, (_, bucket) in self._dispatched.items():
            found = found or key == id(output)
            if found:
                yield bucket

    def requests_from(self, output: object) -> set[str]:
        """Requests with registrations in the step of ``output`` or any later step in flight."""
        return {
            request_id
            for bucket in self._buckets_from(output)
            for request_id in bucket.by_request
            if request_id is not None
        }

    # -- rollback --------------------------------------------------------------------

    def rollback_preempted(self, request_id: str) -> None:
        """Undo ``request_id``'s registrations in the open step, before its blocks are freed.

        A rolled-back block that someone else still holds (``ref_cnt`` above the victim's
        own reference) was counted as computed by that holder in this same step: it is
        *contested* until the scheduler hook withdraws that holder from the step.
        """
        bucket = self.open
        if bucket is None:
            return
        entries = bucket.pop_request(request_id)
        if entries:
            self.stats.rolled_back_preempted += self.unregister(entries)
            for _, block in entries:
                if block.ref_cnt > 1:
                    self._contested_blocks.add(block.block_id)
        if self.preemption_scope is not None:
            self.preemption_scope.after_open_step_rollback(self, request_id)

    @property
    def has_contested_blocks(self) -> bool:
        return bool(self._contested_blocks)

    def take_contested_blocks(self) -> set[int]:
        """The contested block ids so far; the ledger forgets them."""
        contested, self._contested_blocks = self._contested_blocks, set()
        return contested

    def rollback_failed_loads(
        self, output: object, invalid_block_ids: Iterable[int]
    ) -> dict[str, set[int]]:
        """Undo registrations whose KV failed to load in the step of ``output``.

        In that step, each affected request's entries from its first invalid block on;
        in every later step in flight, all of that request's entries (computed on top of
        the invalid KV). The keys undone are kept for :meth:`take_failed_keys`.

        Returns:
            request id -> ids of the blocks whose registration was undone.
        """
        invalid = set(invalid_block_ids)
        affected: dict[str, set[int]] = {}
        buckets = self._buckets_from(output)
        failing = next(buckets, None)
        if failing is None:
            return affected
        for request_id, entries in list(failing.by_request.items()):
            if request_id is None:
                continue
            first = next(
                (i for i, (_, block) in enumerate(entries) if block.block_id in invalid), None
            )
            if first is not None:
                failed = failing.pop_request_from(request_id, first)
                self._failed_keys.update(key for key, _ in failed)
                affected[request_id] = self._undo_failed(failed)
        for bucket in buckets:
            for request_id, undone in affected.items():
                undone |= self._undo_failed(bucket.pop_request(request_id))
        return affected

    def rollback_request_from(self, output: object, request_id: str) -> int:
        """Undo ``request_id``'s entries in the step of ``output`` and every later step in
        flight: that request computed them over KV that failed to load."""
        undone = 0
        for bucket in self._buckets_from(output):
            entries = bucket.pop_request(request_id)
            if entries:
                undone += self.unregister(entries)
        self.stats.rolled_back_kv_load_failure += undone
        return undone

    def take_failed_keys(self) -> set[Any]:
        """Keys undone by failed-load rollbacks since the last call; the ledger forgets them."""
        keys, self._failed_keys = self._failed_keys, set()
        return keys

    def _undo_failed(self, entries: list[Entry]) -> set[int]:
        self.stats.rolled_back_kv_load_failure += self.unregister(entries)
        return {block.block_id for _, block in entries}

    def unregister(self, entries: list[Entry]) -> int:
        """Unregister ``entries`` newest first (the caller has taken them out of their
        bucket, or keeps them on purpose); return how many were still live."""
        unregister = self.pool.guard_unregister
        live = 0
        for key, block in reversed(entries):
            if unregister(key, block):
                live += 1
            else:
                self.stats.stale_entries_skipped += 1
        return live
