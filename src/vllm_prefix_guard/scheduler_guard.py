"""One scheduler's guard: the rules, run where the upstream series calls them, and counted.

:class:`SchedulerGuard` is what the scheduler hooks (:mod:`vllm_prefix_guard.hooks`)
call into. Each of its methods stands for one call the upstream series adds to vLLM's
``Scheduler`` (``upstream/tools/series.py``) and runs the same rule of
:mod:`vllm_prefix_guard.rules`; around it, it counts what the rule did, from the
pool's counters, for ``/metrics`` and the shutdown line. It decides nothing the series
does not.

Cost per step: the two calls that open and close the step's record, the commit, and a
few integer reads; a rollback costs what its rule costs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from vllm_prefix_guard.log import logger
from vllm_prefix_guard.pool import attach
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard.stats import GuardStats


class SchedulerGuard:
    """The rules of one scheduler over its pool, and their counters."""

    def __init__(
        self,
        scheduler: Any,
        rules: UncommittedPrefixCache | None = None,
        rollback_class: type[FailedKVLoads] = FailedKVLoads,
    ) -> None:
        manager = scheduler.kv_cache_manager
        self.scheduler = scheduler
        # vLLM's BlockPool with the table's patches (or a subclass that calls them).
        self.pool: Any = attach(manager.block_pool)
        self.rules = UncommittedPrefixCache(manager) if rules is None else rules
        self.rollback_class = rollback_class
        self.stats = GuardStats()

    # -- the calls the series places in Scheduler -------------------------------------

    def begin_step(self) -> None:
        """``schedule()`` starts (an earlier one that raised is undone here)."""
        left = self.pool.uncommitted_entries
        removed = self.pool.guard_removed
        self.rules.begin_step()
        if left is not None:
            self._count_recorded(left)
            self.stats.rolled_back_dropped_step += self.pool.guard_removed - removed

    def end_step(self, output: Any) -> None:
        """``schedule()`` returns ``output``."""
        entries = self.pool.uncommitted_entries
        self.rules.end_step(output)
        if entries:
            self._count_recorded(entries)
            uncommitted = 0  # num_uncommitted_entries, in this thread: no copies
            for _, step_entries in self.rules.step_id_to_entries.values():
                uncommitted += sum(map(len, step_entries.values()))
            if uncommitted > self.stats.peak_uncommitted_entries:
                self.stats.peak_uncommitted_entries = uncommitted

    def preempted(self, request: Any) -> None:
        """``_preempt_request``, before the request's blocks are freed."""
        open_entries = self.pool.uncommitted_entries
        if open_entries:  # the entries it takes out of the open record, counted here
            self.stats.registrations_tracked += len(open_entries.get(request.request_id, ()))
        removed = self.pool.guard_removed
        # Its computed tokens are those of the steps already dispatched (this step's
        # are added only when schedule() returns): those steps write them.
        self.rules.rollback_preempted(request.request_id, request.num_computed_tokens)
        self.stats.rolled_back_preempted += self.pool.guard_removed - removed

    def all_requests_finishing(self) -> None:
        """``finish_requests(None, ...)``, before vLLM frees them: its fault tolerance
        aborts every request after a fault, and the steps in flight never come back."""
        removed = self.pool.guard_removed
        self.rules.drop_steps_in_flight()
        self.stats.rolled_back_dropped_step += self.pool.guard_removed - removed

    def loads_failed(self, output: Any, invalid_block_ids: Iterable[int]) -> FailedKVLoads:
        """``update_from_output`` got failed loads; before vLLM handles them and reads
        the output (readers vLLM preempted since have their output in flight dropped)."""
        removed = self.pool.guard_removed
        rollback = self.rollback_class(self.rules)
        rollback.roll_back(output, set(invalid_block_ids))
        self.stats.rolled_back_kv_load_failure += self.pool.guard_removed - removed
        self._count_readers(rollback.drop_stale_output(self.scheduler.requests))
        return rollback

    def preempt_bad_kv_readers(self, rollback: FailedKVLoads) -> None:
        """After vLLM handled failed loads: every running request that still counts bad
        KV as computed recomputes it (its in-flight output dropped, as
        ``reset_prefix_cache`` does)."""
        if not rollback.loaders and not rollback.readers:
            return
        scheduler = self.scheduler
        readers = [request for request in scheduler.running if rollback.reads_bad_kv(request)]
        timestamp = time.monotonic()
        for request in readers:
            scheduler.running.remove(request)
            scheduler._preempt_request(request, timestamp, drop_stale_output=True)
        self._count_readers(len(readers))

    def commit_step(self, output: Any) -> None:
        """``update_from_output`` for ``output`` is done."""
        removed = self.pool.guard_removed
        in_flight = len(self.rules.step_id_to_entries)
        self.rules.commit_step(output)
        if len(self.rules.step_id_to_entries) != in_flight:
            self.stats.steps_committed += 1
            if self.pool.guard_removed != removed:
                self.stats.rolled_back_dropped_step += self.pool.guard_removed - removed

    def prefix_cache_reset(self) -> None:
        """After ``Scheduler.reset_prefix_cache``: drop every record if the pool caches
        nothing now (it did reset; the scheduler's own result also reflects the
        connector's reset). With no entry left, no record names a live one."""
        if not len(self.pool.cached_block_hash_to_block):
            if self.pool.uncommitted_entries:
                self._count_recorded(self.pool.uncommitted_entries)
            self.rules.reset()

    # -- what operators read ------------------------------------------------------------

    @property
    def is_idle(self) -> bool:
        """No step open, none in flight, nothing uncommitted."""
        return self.pool.uncommitted_entries is None and not self.rules.step_id_to_entries

    def counters(self) -> dict[str, int]:
        """The counters as operators read them. Safe from another thread: integer reads
        and one pass over the records in flight, each listed at once under the GIL."""
        stats = self.stats
        stats.stale_entries_skipped = self.pool.stale_entries_skipped
        return {**stats.as_dict(), "uncommitted_entries": self.num_uncommitted_entries}

    @property
    def num_uncommitted_entries(self) -> int:
        """Entries of the steps in flight (O(requests in their records)); each record
        is listed at once, so another thread may read it."""
        return sum(
            sum(map(len, list(entries.values()))) for _, entries in self.rules.steps_in_flight()
        )

    def _count_recorded(self, entries: Any) -> None:
        """Count the entries of the open step's record that leave it (it ends, a request
        preempted inside it takes its own, or it is dropped): per step, where recording
        each one would cost per registration."""
        self.stats.registrations_tracked += sum(map(len, entries.values()))

    def _count_readers(self, preempted: int) -> None:
        """Count requests made to recompute for reading bad KV (preempted here, or
        already preempted by vLLM and their output in flight dropped); warn the first
        time."""
        if not preempted:
            return
        first = self.stats.dependents_preempted == 0
        self.stats.dependents_preempted += preempted
        if first:
            logger().warning(
                "vllm-prefix-guard: preempted %d request(s) that counted KV of a failed load "
                "(or KV computed over it) as computed; they recompute (logged once per "
                "scheduler).",
                preempted,
            )
