"""The step ledger: which speculative registrations each scheduler step made, until it commits.

One bucket per ``schedule()`` call. While the call runs the bucket is *open*: the pool
records into it every ``(key, block)`` pair that ``allocate_slots`` newly registers, with
the prefix length the key names. When ``schedule()`` returns, the bucket is
*dispatched*, keyed by the identity of the ``SchedulerOutput`` it produced (not by a
counter, so dropped or foreign outputs cannot shift the pairing). ``update_from_output``
for that output *commits* it, after the step's KV-load failures were rolled back.

Rollback rules (why each exists is in the README's design section). Each undoes exactly
the entries whose KV is not, or will not be, what their key names:

- preemption inside ``schedule()`` rolls back the victim's entries in the open bucket
  only, and of those only the ones its dispatched steps do not write: dispatched steps
  cannot be cancelled and write their blocks (a block whose last token became known
  only after its step was dispatched is registered one step late, and stays). The
  :class:`PreemptionScope` policy can widen this, to measure what that costs;
- a KV-load failure rolls back, in the failing step, each loader's entries from its
  first invalid block on; then, walking the failing step and every later step in
  flight, the entries each request *computed* over bad KV: the loaders' (until they are
  admitted afresh), and those of every request admitted on a hit that includes a bad
  block (a failed load or an entry rolled back here), found from the admissions the
  in-flight ``SchedulerOutput``s carry. Blocks a reader loaded from the connector do not
  depend on the KV it read and stay;
- a dispatched step that never comes back (its successor commits first) is rolled back
  whole; ``reset_prefix_cache`` drops every bucket.

The ledger owns what the scheduler hooks need to resolve after a rollback: blocks rolled
back while another request held them (*contested*), and the readers of failed loads.

Cost: O(1) per step plus O(1) per recorded registration; rollback is O(entries undone),
plus, on a KV-load failure only, O(blocks the in-flight steps' admissions hit).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from vllm_prefix_guard.pool import PrefixGuardPool
from vllm_prefix_guard.stats import GuardStats

# (key, block, prefix length the key names) as recorded by the pool.
Entry = tuple[Any, Any, "int | None"]

# (request id, its block ids per KV-cache group, tokens computed when admitted): one
# request admitted (new or resumed) by a step, read off its SchedulerOutput.
Admission = tuple[str, Sequence[Sequence[int]], int]

# Why entries are undone: the ledger path, as diagnostics classify rollbacks.
PREEMPTED = "preempted"
LOADER = "kv_load_failure: loader, failing step"
LOADER_LATER = "kv_load_failure: loader, later step in flight"
READER = "kv_load_failure: reader, computed over bad KV"
DROPPED_STEP = "dropped_step"
ABANDONED_STEP = "abandoned_step"


def written_below(entry: Entry, upto: int) -> bool:
    """Whether every token the entry's key names lies below ``upto``."""
    num_tokens = entry[2]
    return num_tokens is not None and 0 < num_tokens <= upto


def blocks_read(
    block_ids: Sequence[Sequence[int]], num_computed: int, block_sizes: Sequence[int]
) -> Iterator[int]:
    """The blocks, in every KV-cache group, that hold a request's first ``num_computed``
    tokens (each group in its own block size)."""
    for group, size in zip(block_ids, block_sizes, strict=True):
        yield from group[: -(-num_computed // size)]


def block_start(entry: Entry, block_size: int) -> int:
    """The first token of the block an entry registered (0 when its length is unknown)."""
    num_tokens = entry[2]
    return 0 if not num_tokens else (num_tokens - 1) // block_size * block_size


class SchedulerView(Protocol):
    """What a failed-load rollback needs to know of the scheduler (``recovery`` gives it)."""

    @property
    def group_block_sizes(self) -> Sequence[int]:
        """Tokens per block of each KV-cache group (a hybrid model's groups differ)."""
        ...

    def admissions(self, output: object) -> Iterable[Admission]:
        """The requests the step of ``output`` admitted, and on which blocks."""
        ...

    def holds(self, request_id: str, block_id: int) -> bool:
        """Whether a request still runs holding a block (taken after any reuse of it)."""
        ...

    def starts(self, output: object) -> Mapping[str, int]:
        """Request id -> the first token the step of ``output`` computes for it, for
        every request it schedules."""
        ...

    def block_size_of(self, key: Any) -> int:
        """Tokens per block of the KV-cache group a registration's key belongs to."""
        ...


class FailedLoads(dict[str, set[int]]):
    """Loader id -> block ids undone, plus the readers of bad KV (see the ledger)."""

    readers: set[str]
    # Block id -> whether an entry undone on it was still registered.
    bad_blocks: dict[int, bool]

    def __init__(self) -> None:
        super().__init__()
        self.readers = set()
        self.bad_blocks = {}


class StepBucket:
    """The registrations of one scheduler step, grouped by the request that made them.

    Entries of ``None`` were made on no request's behalf (Mamba copy-on-write moves:
    the copy runs even if the request is preempted, so only a dropped step undoes them).
    """

    __slots__ = ("by_request", "size")

    def __init__(self) -> None:
        self.by_request: dict[str | None, list[Entry]] = {}
        self.size = 0

    def record(
        self, request_id: str | None, key: Any, block: Any, num_tokens: int | None = None
    ) -> None:
        entries = self.by_request.get(request_id)
        if entries is None:
            self.by_request[request_id] = [(key, block, num_tokens)]
        else:
            entries.append((key, block, num_tokens))
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

    def keep(self, request_id: str, entries: list[Entry]) -> None:
        """Put (back) entries of ``request_id`` into this bucket."""
        if entries:
            self.by_request.setdefault(request_id, []).extend(entries)
            self.size += len(entries)

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


class LedgerObserver(Protocol):
    """What diagnostics see of a ledger (the fuzzer's rollback audit): steps dispatched
    and committed, failed loads, and every undo, which it may narrow (the audit's ideal
    policy keeps entries whose KV is right)."""

    def step_dispatched(self, output: object, bucket: StepBucket) -> None: ...

    def step_committed(self, output: object, bucket: StepBucket) -> None: ...

    def loads_failed(self, output: object, invalid_block_ids: set[int]) -> None: ...

    def undoing(self, cause: str, request_id: str | None, entries: list[Entry]) -> list[Entry]:
        """The entries to undo after all (the others stay registered)."""
        ...

    def preempting_readers(self, readers: set[str]) -> set[str]:
        """The readers of bad KV to preempt after all."""
        ...


class StepLedger:
    """Per-scheduler FIFO of uncommitted registration buckets over one guarded pool."""

    def __init__(
        self,
        pool: PrefixGuardPool,
        preemption_scope: PreemptionScope | None = None,
        observer: LedgerObserver | None = None,
    ):
        self.pool = pool
        self.stats = GuardStats()
        self.preemption_scope = preemption_scope
        self.observer = observer
        self.open: StepBucket | None = None
        # id(SchedulerOutput) -> (output, bucket), in dispatch order. The output is held
        # so its id cannot be reused while the step is in flight.
        self._dispatched: dict[int, tuple[object, StepBucket]] = {}
        # Blocks rolled back in the open step while another request still held them.
        self._contested_blocks: set[int] = set()
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
        if self.observer is not None:
            self.observer.step_dispatched(output, bucket)

    def abandon_step(self) -> None:
        """``schedule()`` raised: its step will never run, so undo what it registered."""
        bucket = self.open
        self.open = None
        self.pool.guard_record_into(None)
        self._contested_blocks.clear()
        if bucket is not None:
            for request_id, entries in list(bucket.by_request.items()):
                self.stats.rolled_back_dropped_step += self.unregister(
                    entries, ABANDONED_STEP, request_id
                )
            bucket.pop_all()

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
                if self.observer is not None:
                    self.observer.step_committed(output, bucket)
                return
            for request_id, entries in list(bucket.by_request.items()):
                self.stats.rolled_back_dropped_step += self.unregister(
                    entries, DROPPED_STEP, request_id
                )
            bucket.pop_all()

    def clear(self) -> None:
        """Forget every bucket: the pool's hashes were all reset."""
        self._dispatched.clear()
        if self.open is not None:
            self.open = StepBucket()
            self.pool.guard_record_into(self.open)
        self._contested_blocks.clear()
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

    def _in_flight_from(self, output: object) -> list[tuple[object, StepBucket]]:
        """The step of ``output`` and every later step in flight, in dispatch order."""
        steps = list(self._dispatched.items())
        for index, (key, _) in enumerate(steps):
            if key == id(output):
                return [entry for _, entry in steps[index:]]
        return []

    # -- rollback --------------------------------------------------------------------

    def rollback_preempted(self, request_id: str, written_upto: int = 0) -> None:
        """Undo ``request_id``'s registrations in the open step, before its blocks are freed.

        Entries whose tokens all lie below ``written_upto`` (the victim's computed tokens
        before this step: its dispatched steps write them) stay registered and move to
        the latest step in flight: a block registered one step after the step that
        writes it (its last token was sampled by a step still in flight) holds valid KV
        once that step ran.

        A rolled-back block that someone else still holds (``ref_cnt`` above the victim's
        own reference) was counted as computed by that holder in this same step: it is
        *contested* until the scheduler hook withdraws that holder from the step.
        """
        bucket = self.open
        if bucket is None:
            return
        entries = bucket.pop_request(request_id)
        if entries and written_upto:
            written = [e for e in entries if written_below(e, written_upto)]
            if written and self._dispatched:
                # Written by a step in flight: they live or die with the latest one (a
                # failed load or a drop there undoes them like its own entries).
                _, latest = next(reversed(self._dispatched.values()))
                latest.keep(request_id, written)
            # (Nothing in flight: committed steps wrote them; they are final.)
            entries = [e for e in entries if not written_below(e, written_upto)]
        if entries:
            self.stats.rolled_back_preempted += self.unregister(entries, PREEMPTED, request_id)
            for _, block, _ in entries:
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
        self,
        output: object,
        invalid_block_ids: Iterable[int],
        scheduler: SchedulerView | None = None,
    ) -> FailedLoads:
        """Undo registrations whose KV failed to load in the step of ``output``, and every
        registration computed over such KV in that step or a later one in flight.

        A loader loses, in every KV-cache group, its entries past the first token whose
        KV failed (in any group: a hybrid model computes every group's KV of a token
        from all groups' KV of the tokens before it). Without ``scheduler`` (which
        requests each step admitted, on which blocks) only the loaders are followed, and
        all their later in-flight entries go.

        Returns:
            loader id -> ids of the blocks whose registration was undone, with
            :attr:`FailedLoads.readers`: the other requests that computed over bad KV and
            still count it as computed in their latest admission.
        """
        invalid = set(invalid_block_ids)
        if self.observer is not None:
            self.observer.loads_failed(output, invalid)
        steps = self._in_flight_from(output)
        result = FailedLoads()
        if not steps:
            return result
        # Block id -> whether an undone entry on it was still registered (False: the
        # block was evicted and reused since, so a hit on it may be on its new content).
        bad: dict[int, bool] = dict.fromkeys(invalid, False)
        loaders = self._undo_loaders(steps[0][1], invalid, bad, result, scheduler)
        # Request -> whether its computation in the step being walked reads bad KV.
        tainted = dict.fromkeys(loaders, True)
        # Reader -> the bucket of its admission, where the entries it had loaded or
        # written before reading bad KV were kept.
        kept: dict[str, StepBucket] = {}
        for index, (step_output, bucket) in enumerate(steps):
            admitted: dict[str, tuple[Sequence[Sequence[int]], int]] = {}
            if scheduler is not None:
                for request_id, block_ids, num_computed in scheduler.admissions(step_output):
                    if index or request_id not in loaders:
                        admitted[request_id] = (block_ids, num_computed)
                        tainted.pop(request_id, None)  # admitted afresh: judged below
                        kept.pop(request_id, None)
                if index and kept:
                    self._undo_rewritten(kept, scheduler.starts(step_output), bad)
            if index:
                # Tainted since an earlier step: all of it was computed over bad KV.
                for owner in list(bucket.by_request):
                    if owner is not None and tainted.get(owner):
                        cause = LOADER_LATER if owner in loaders else READER
                        undone = self._undo_bad(bucket.pop_request(owner), bad, cause, owner)
                        if owner in result:
                            result[owner].update(undone)
            if scheduler is None:
                continue
            # Admissions on a hit that includes a bad block, until none is left to add
            # (a same-step hit on a block a reader registered here is bad as well).
            changed = True
            while changed:
                changed = False
                for request_id, (block_ids, num_computed) in list(admitted.items()):
                    own = {e[1].block_id for e in bucket.by_request.get(request_id, ())}
                    if not any(
                        block_id in bad
                        and block_id not in own
                        and (bad[block_id] or not scheduler.holds(request_id, block_id))
                        for block_id in blocks_read(
                            block_ids, num_computed, scheduler.group_block_sizes
                        )
                    ):
                        continue
                    del admitted[request_id]
                    tainted[request_id] = True
                    # What it loaded or had written before this step does not depend on
                    # what it reads here; what it computes here does.
                    self._undo_computed_from(bucket, request_id, num_computed, bad)
                    kept[request_id] = bucket
                    changed = True
        readers = {r for r, t in tainted.items() if t and r not in loaders}
        if self.observer is not None:
            readers = self.observer.preempting_readers(readers)
        result.readers = readers
        result.bad_blocks = bad
        return result

    def _undo_rewritten(
        self, kept: dict[str, StepBucket], starts: Mapping[str, int], bad: dict[int, bool]
    ) -> None:
        """A reader that a later step in flight computes from a lower token than it was
        admitted with (vLLM rewound it: a failed load it was blamed for, by block id, on
        a block it had loaded since) rewrites, over bad KV, blocks whose entries were kept
        as loaded: those go too."""
        for request_id, bucket in kept.items():
            start = starts.get(request_id)
            if start is not None:
                self._undo_computed_from(bucket, request_id, start, bad)

    def _undo_computed_from(
        self, bucket: StepBucket, request_id: str, start: int, bad: dict[int, bool]
    ) -> None:
        """Undo a reader's entries in ``bucket`` that reach past token ``start`` (computed
        from there, over bad KV); keep those written below it."""
        entries = bucket.pop_request(request_id)
        bucket.keep(request_id, [e for e in entries if written_below(e, start)])
        self._undo_bad([e for e in entries if not written_below(e, start)], bad, READER, request_id)

    def _undo_loaders(
        self,
        bucket: StepBucket,
        invalid: set[int],
        bad: dict[int, bool],
        result: FailedLoads,
        scheduler: SchedulerView | None,
    ) -> set[str]:
        """Undo each loader's entries past its first failed token; return the loaders.

        Without ``scheduler`` (block sizes unknown) a loader loses its entries from its
        first invalid one on, which is the same thing for a single KV-cache group.
        """
        loaders = set()
        for request_id, entries in list(bucket.by_request.items()):
            if request_id is None:
                continue
            first = next((i for i, e in enumerate(entries) if e[1].block_id in invalid), None)
            if first is None:
                continue
            if scheduler is None:
                failed = bucket.pop_request_from(request_id, first)
            else:
                failed_from = min(
                    block_start(e, scheduler.block_size_of(e[0]))
                    for e in entries
                    if e[1].block_id in invalid
                )
                bucket.pop_request(request_id)
                bucket.keep(request_id, [e for e in entries if written_below(e, failed_from)])
                failed = [e for e in entries if not written_below(e, failed_from)]
            result[request_id] = self._undo_bad(failed, bad, LOADER, request_id)
            loaders.add(request_id)
        return loaders

    def _undo_bad(
        self, entries: list[Entry], bad: dict[int, bool], cause: str, request_id: str
    ) -> set[int]:
        """Undo entries computed over (or loaded as) bad KV; their blocks become bad."""
        if not entries:
            return set()
        if self.observer is not None:
            entries = self.observer.undoing(cause, request_id, entries)
        unregister = self.pool.guard_unregister
        for key, block, _ in reversed(entries):
            live = unregister(key, block)
            if live:
                self.stats.rolled_back_kv_load_failure += 1
            else:
                self.stats.stale_entries_skipped += 1
            bad[block.block_id] = bad.get(block.block_id, False) or live
        return {entry[1].block_id for entry in entries}

    def unregister(
        self, entries: list[Entry], cause: str = "", request_id: str | None = None
    ) -> int:
        """Unregister ``entries`` newest first (the caller has taken them out of their
        bucket, or keeps them on purpose); return how many were still live."""
        if self.observer is not None:
            entries = self.observer.undoing(cause, request_id, entries)
        unregister = self.pool.guard_unregister
        live = 0
        for key, block, _ in reversed(entries):
            if unregister(key, block):
                live += 1
            else:
                self.stats.stale_entries_skipped += 1
        return live
