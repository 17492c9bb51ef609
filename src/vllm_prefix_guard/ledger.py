"""The step ledger: which speculative registrations each scheduler step made, until it commits.

One bucket per ``schedule()`` call. While the call runs the bucket is *open*: the pool
records into it every ``(key, block)`` pair that ``allocate_slots`` newly registers. When
``schedule()`` returns, the bucket is *dispatched*, keyed by the identity of the
``SchedulerOutput`` it produced (not by a counter, so dropped or foreign outputs cannot
shift the pairing). ``update_from_output`` for that output *commits* it, after the
step's KV-load failures were rolled back.

Rollback rules (why each exists is in the README's design section):

- preemption inside ``schedule()`` rolls back the victim's entries in the open bucket
  only: dispatched steps cannot be cancelled and will write their blocks;
- a KV-load failure rolls back, in the failing step, each affected request's entries
  from its first invalid block on, and that request's entries in later in-flight steps
  (computed on top of the invalid KV);
- a dispatched step that never comes back (its successor commits first) is rolled back
  whole; ``reset_prefix_cache`` drops every bucket.

Cost: O(1) per step plus O(1) per recorded registration; rollback is O(entries undone).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

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
        entries = self.by_request.pop(request_id, None) or []
        self.size -= len(entries)
        return entries


class StepLedger:
    """Per-scheduler FIFO of uncommitted registration buckets over one guarded pool."""

    def __init__(self, pool: PrefixGuardPool) -> None:
        self.pool = pool
        self.stats = GuardStats()
        self.open: StepBucket | None = None
        # id(SchedulerOutput) -> (output, bucket), in dispatch order. The output is held
        # so its id cannot be reused while the step is in flight.
        self._dispatched: dict[int, tuple[object, StepBucket]] = {}
        # Blocks rolled back while another request still held them (see hooks).
        self.contested_blocks: set[int] = set()
        # Keys of the entries the last failed-load rollback removed (see hooks).
        self.failed_keys: set[Any] = set()
        self._epoch = pool.guard_epoch

    # -- step lifecycle --------------------------------------------------------------

    @property
    def steps_in_flight(self) -> int:
        return len(self._dispatched)

    @property
    def is_idle(self) -> bool:
        """No open step, no step in flight, nothing uncommitted."""
        return self.open is None and not self._dispatched and not self.stats.uncommitted_entries

    def begin_step(self) -> None:
        """Open the bucket of a ``schedule()`` call; the pool records into it."""
        if self.pool.guard_epoch != self._epoch:
            self.clear()
        bucket = StepBucket()
        self.open = bucket
        self.pool._guard_sink = bucket

    def dispatch_step(self, output: object) -> None:
        """Close the open bucket and tie it to the ``SchedulerOutput`` it belongs to."""
        bucket = self.open
        assert bucket is not None, "dispatch_step without begin_step"
        self.open = None
        self.pool._guard_sink = None
        self._dispatched[id(output)] = (output, bucket)
        if bucket.size:
            stats = self.stats
            stats.registrations_tracked += bucket.size
            stats.uncommitted_entries += bucket.size
            if stats.uncommitted_entries > stats.peak_uncommitted_entries:
                stats.peak_uncommitted_entries = stats.uncommitted_entries

    def abandon_step(self) -> None:
        """``schedule()`` raised: its step will never run, so undo what it registered."""
        bucket = self.open
        self.open = None
        self.pool._guard_sink = None
        if bucket is not None:
            for entries in bucket.by_request.values():
                self.stats.rolled_back_dropped_step += self._undo(entries)

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
            self.stats.uncommitted_entries -= bucket.size
            if oldest == key:
                self.stats.steps_committed += 1
                return
            for entries in bucket.by_request.values():
                self.stats.rolled_back_dropped_step += self._undo(entries)

    def clear(self) -> None:
        """Forget every bucket: the pool's hashes were all reset."""
        self._dispatched.clear()
        if self.open is not None:
            self.open = StepBucket()
            self.pool._guard_sink = self.open
        self.stats.uncommitted_entries = 0
        self.contested_blocks.clear()
        self._epoch = self.pool.guard_epoch

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Stop recording, for confirmed registrations made inside ``schedule()``."""
        sink = self.pool._guard_sink
        self.pool._guard_sink = None
        try:
            yield
        finally:
            self.pool._guard_sink = sink

    # -- rollback --------------------------------------------------------------------

    def rollback_preempted(self, request_id: str) -> None:
        """Undo ``request_id``'s registrations in the open step, before its blocks are freed.

        A rolled-back block that someone else still holds (``ref_cnt`` above the victim's
        own reference) was counted as computed by that holder in this same step; it is
        added to :attr:`contested_blocks` for the scheduler hook to resolve.
        """
        bucket = self.open
        if bucket is None:
            return
        entries = bucket.pop_request(request_id)
        if not entries:
            return
        self.stats.rolled_back_preempted += self._undo(entries)
        for _, block in entries:
            if block.ref_cnt > 1:
                self.contested_blocks.add(block.block_id)

    def rollback_failed_loads(
        self, output: object, invalid_block_ids: Iterable[int]
    ) -> dict[str, set[int]]:
        """Undo registrations whose KV failed to load in the step of ``output``.

        The keys of the failed entries are kept in :attr:`failed_keys` for the hook that
        looks for requests built on them.

        Returns:
            request id -> ids of the blocks whose registration was undone.
        """
        invalid = set(invalid_block_ids)
        affected: dict[str, set[int]] = {}
        found = False
        for key, (_, bucket) in self._dispatched.items():
            if not found:
                if key != id(output):
                    continue
                found = True
                self._collect_failed(bucket, invalid, affected)
            else:
                # Later in-flight steps computed on top of the invalid KV.
                for request_id, undone in affected.items():
                    self._undo_request(bucket, request_id, undone)
        return affected

    def requests_from(self, output: object) -> set[str]:
        """Requests with registrations in the step of ``output`` or any later step in flight."""
        found = False
        requests: set[str] = set()
        for key, (_, bucket) in self._dispatched.items():
            found = found or key == id(output)
            if found:
                requests.update(r for r in bucket.by_request if r is not None)
        return requests

    def rollback_request_from(self, output: object, request_id: str) -> int:
        """Undo ``request_id``'s entries in the step of ``output`` and every later step in
        flight: that request computed them over KV that failed to load."""
        undone = 0
        found = False
        for key, (_, bucket) in self._dispatched.items():
            found = found or key == id(output)
            if found:
                entries = bucket.pop_request(request_id)
                if entries:
                    self.stats.uncommitted_entries -= len(entries)
                    undone += self._undo(entries)
        self.stats.rolled_back_kv_load_failure += undone
        return undone

    def _collect_failed(
        self, bucket: StepBucket, invalid: set[int], affected: dict[str, set[int]]
    ) -> None:
        for request_id, entries in list(bucket.by_request.items()):
            if request_id is None:
                continue
            first = next(
                (i for i, (_, block) in enumerate(entries) if block.block_id in invalid),
                None,
            )
            if first is None:
                continue
            failed = entries[first:]
            del entries[first:]
            self.failed_keys.update(key for key, _ in failed)
            bucket.size -= len(failed)
            self.stats.uncommitted_entries -= len(failed)
            self.stats.rolled_back_kv_load_failure += self._undo(failed)
            affected[request_id] = {block.block_id for _, block in failed}

    def _undo_request(self, bucket: StepBucket, request_id: str, undone: set[int]) -> None:
        entries = bucket.pop_request(request_id)
        if entries:
            self.stats.uncommitted_entries -= len(entries)
            self.stats.rolled_back_kv_load_failure += self._undo(entries)
            undone.update(block.block_id for _, block in entries)

    def _undo(self, entries: list[Entry]) -> int:
        """Unregister ``entries`` newest first; return how many were still live."""
        unregister = self.pool.guard_unregister
        live = 0
        for key, block in reversed(entries):
            if unregister(key, block):
                live += 1
            else:
                self.stats.stale_entries_skipped += 1
        return live
