# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries of scheduler steps whose KV is not written yet.

`KVCacheManager.allocate_slots` registers the blocks a step is about to
compute, so that requests in the same batch can share them (identical prompts,
`n > 1`: one forward pass writes a block before attention reads it). The KV is
written only when the step runs; until its output comes back, the step's
entries are *uncommitted*. An entry whose KV is never written is a silent wrong
answer for every later request that hits it. The rules below remove exactly the
entries whose KV is not, or will not be, what their hash names; every other
entry stays cached, so no valid hit is lost.

1. A request preempted inside `schedule()` (priority policy: the victim may
   already be scheduled in this call) never runs the step being scheduled: its
   entries of that step are removed before its blocks are freed. Entries whose
   tokens all lie below its computed tokens stay: a step already dispatched
   writes them (a block whose last token was sampled by a step in flight is
   registered one step late). Dispatched steps are never cancelled, so entries
   of steps in flight are never removed for a preemption.
2. A step whose output never comes back (a later step commits first) wrote
   nothing: its entries are removed when the later step commits.
3. A `schedule()` that raised produced no step: its entries are removed when
   the next step begins.
4. `reset_prefix_cache` removes every entry: the records are dropped.
5. Blocks a KV connector finished loading (`_update_waiting_for_remote_kv`)
   hold written KV: their entries are made inside `written()` and not
   recorded. `cache_blocks` outside `schedule()` runs with no step open.

Same-step sharing needs no rule: lookups run only in the waiting loop of
`schedule()`, which is skipped once the running loop preempted a request, so
no request can hit an entry whose writer is then preempted in the same call.

Steps are keyed by the identity of their `SchedulerOutput`, not by a counter:
`update_from_output` receives the output object and nothing else that names
the step, and a counter would pair the wrong records as soon as one output is
dropped, or an output `schedule()` did not produce (the empty one `EngineCore`
passes while it drains) comes back. The record holds its output, so the id
cannot be reused while the step is in flight.

Cost: O(1) per step and per registration; a removal is O(entries removed).
"""

from collections.abc import Collection, Iterator
from contextlib import contextmanager

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_prefix_guard.rules.block_pool import StepCacheEntries, UncommittedEntry
from vllm_prefix_guard.rules.failed_kv_loads import (
    FailedKVLoads,
    first_computed_tokens,
)


class UncommittedPrefixCache:
    """The uncommitted prefix-cache entries of each scheduler step, in order.

    `begin_step` opens a record at the start of `Scheduler.schedule()`; the
    block pool appends every new entry to it. `end_step` ties it to the
    `SchedulerOutput` the call returns, and `commit_step` drops it at the end of
    `Scheduler.update_from_output` for that output. Every removal goes through
    `remove_entry`.
    """

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        # id(SchedulerOutput) -> (output, its entries), oldest first.
        self._in_flight: dict[int, tuple[SchedulerOutput, StepCacheEntries]] = {}

    @property
    def num_steps_in_flight(self) -> int:
        return len(self._in_flight)

    @property
    def num_uncommitted_entries(self) -> int:
        """Entries of the steps in flight (O(requests in their records))."""
        return sum(
            sum(map(len, list(entries.values())))
            for _, entries in list(self._in_flight.values())
        )

    def steps_in_flight(self) -> list[tuple[SchedulerOutput, StepCacheEntries]]:
        """The steps dispatched and not committed, oldest first."""
        return list(self._in_flight.values())

    def begin_step(self) -> None:
        """Record the new prefix-cache entries of the step being scheduled."""
        block_pool = self.kv_cache_manager.block_pool
        if block_pool.uncommitted_entries is not None:
            # The last `schedule()` raised: its step never runs.
            self._remove_step(block_pool.uncommitted_entries)
        block_pool.uncommitted_entries = {}

    def end_step(self, scheduler_output: SchedulerOutput) -> None:
        """Stop recording; the entries await the output of `scheduler_output`."""
        block_pool = self.kv_cache_manager.block_pool
        entries = block_pool.uncommitted_entries
        assert entries is not None, "end_step() without begin_step()"
        block_pool.uncommitted_entries = None
        self._in_flight[id(scheduler_output)] = (scheduler_output, entries)

    def commit_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step of `scheduler_output` ran: its entries are valid. Older
        steps still in flight never will be (their outputs were dropped).

        An output `schedule()` did not produce has no record and commits
        nothing: it ran no step.
        """
        step_id = id(scheduler_output)
        if step_id not in self._in_flight:
            return
        while True:
            oldest_id = next(iter(self._in_flight))
            _, entries = self._in_flight.pop(oldest_id)
            if oldest_id == step_id:
                return
            self._remove_step(entries)

    def reset(self) -> None:
        """Forget every record: the prefix cache was reset."""
        self._in_flight.clear()
        block_pool = self.kv_cache_manager.block_pool
        if block_pool.uncommitted_entries is not None:
            block_pool.uncommitted_entries = {}

    @contextmanager
    def written(self) -> Iterator[None]:
        """Record nothing inside: the entries made there name KV already
        written (blocks a KV connector finished loading)."""
        block_pool = self.kv_cache_manager.block_pool
        entries, block_pool.uncommitted_entries = block_pool.uncommitted_entries, None
        try:
            yield
        finally:
            block_pool.uncommitted_entries = entries

    def rollback_preempted(self, req_id: str, num_written_tokens: int) -> None:
        """Remove the open step's entries of a request preempted inside
        `schedule()`, before its blocks are freed.

        Args:
            req_id: The preempted request.
            num_written_tokens: Its computed tokens before this step: the steps
                already dispatched write them. Its entries that lie below stay,
                tied to the latest step in flight (they are written once it
                ran, and go if it never comes back).

        """
        open_entries = self.kv_cache_manager.block_pool.uncommitted_entries
        if open_entries is None:
            return
        entries = open_entries.pop(req_id, [])
        if entries and num_written_tokens:
            written, entries = self.split_written(entries, num_written_tokens)
            if self._in_flight:
                _, latest = next(reversed(self._in_flight.values()))
                self.keep(latest, req_id, written)
        self.remove_entries(req_id, entries)

    def rollback_failed_loads(
        self,
        scheduler_output: SchedulerOutput,
        invalid_block_ids: set[int],
        running_req_ids: set[str],
        loader_req_ids: Collection[str] | None = None,
    ) -> FailedKVLoads:
        """Remove the entries a failed KV load leaves without valid KV in the
        step of `scheduler_output` and the steps in flight after it, and find
        the requests that read such KV (see `FailedKVLoads`).

        Args:
            scheduler_output: The step that reported the failure.
            invalid_block_ids: The blocks whose load failed.
            running_req_ids: The running requests, before the failure is
                handled.
            loader_req_ids: The requests whose loads failed, if known (None:
                every holder of an invalid block in that step).

        """
        rollback = FailedKVLoads(self, running_req_ids)
        rollback.roll_back(scheduler_output, invalid_block_ids, loader_req_ids)
        return rollback

    def gather_not_computed(
        self, scheduler_output: SchedulerOutput, computed_req_ids: Collection[str]
    ) -> dict[str, set[int]]:
        """Find the requests of the step of `scheduler_output` that its output
        leaves out, and move their entries of the later steps in flight into
        this step's record; return, for each, the blocks of those whose KV or
        state is not written.

        vLLM's runners compute every request of a step they were given, one
        aborted meanwhile included (it leaves the batch only when a later step
        lists it as finished), and list exactly those in their output;
        `update_from_output` looks up every request it has not seen finish. So
        an output can only leave out a request that finished while the step
        was in flight, and then only from a worker that dropped it from the
        steps it had been given: nothing they registered for it past the
        tokens it had computed before this step is written (a later step may
        have registered a block whose last token this step was to compute; one
        that resumed it after a preemption that dropped its output, a block
        whose tokens it computes again), and a request admitted on a hit of
        it, in this step or one in flight after it, read or will read it. The
        caller rolls these blocks back as a failed KV load's
        (`rollback_failed_loads`), from this step on, where the request's
        entries now are, naming these requests its loaders: a block of an
        entry moved here can also hold an entry of this step that another
        request wrote before a later step preempted it and handed the block
        on. Steps with no tokens scheduled (the empty output, a
        KV-connector-only step) register nothing, and an output `schedule()`
        did not produce has no record.

        Args:
            scheduler_output: The step whose output came back.
            computed_req_ids: The requests the output lists
                (`ModelRunnerOutput.req_ids`).

        Returns:
            Each request left out with entries not written -> their blocks;
            empty if the output lists every request of the step (O(1); else
            O(requests of the steps in flight + their entries)).

        """
        num_scheduled_tokens = scheduler_output.num_scheduled_tokens
        if len(computed_req_ids) >= len(num_scheduled_tokens):
            return {}
        record = self._in_flight.get(id(scheduler_output))
        if record is None:
            return {}
        computed_req_ids = set(computed_req_ids)
        steps = list(self._in_flight.values())
        index = next(i for i, (output, _) in enumerate(steps) if output is record[0])
        entries = record[1]
        starts = [first_computed_tokens(output) for output, _ in steps[index:]]
        not_computed: dict[str, set[int]] = {}
        for req_id in num_scheduled_tokens:
            if req_id in computed_req_ids:
                continue
            for _, later in steps[index + 1 :]:
                self.keep(entries, req_id, later.pop(req_id, []))
            # A request preempted with its output dropped may resume in a later
            # step in flight from fewer tokens, which it then computes again.
            computed_before = min(
                step_starts[req_id] for step_starts in starts if req_id in step_starts
            )
            _, unwritten = self.split_written(entries.get(req_id, []), computed_before)
            if unwritten:
                not_computed[req_id] = {block.block_id for _, block, _ in unwritten}
        return not_computed

    @staticmethod
    def split_written(
        entries: list[UncommittedEntry], num_tokens: int
    ) -> tuple[list[UncommittedEntry], list[UncommittedEntry]]:
        """(The entries whose tokens all lie below `num_tokens`, the others.)"""
        written: list[UncommittedEntry] = []
        unwritten: list[UncommittedEntry] = []
        for entry in entries:
            num_hash_tokens = entry[2]
            if num_hash_tokens is not None and 0 < num_hash_tokens <= num_tokens:
                written.append(entry)
            else:
                unwritten.append(entry)
        return written, unwritten

    @staticmethod
    def keep(
        entries: StepCacheEntries, req_id: str | None, kept: list[UncommittedEntry]
    ) -> None:
        """Put (back) entries of `req_id` into a step's record."""
        if kept:
            entries.setdefault(req_id, []).extend(kept)

    def remove_entries(
        self, req_id: str | None, entries: list[UncommittedEntry]
    ) -> None:
        """Remove entries of `req_id` from the prefix cache, newest first."""
        for entry in reversed(entries):
            self.remove_entry(req_id, entry)

    def remove_entry(self, req_id: str | None, entry: UncommittedEntry) -> bool:
        """Remove one entry of `req_id` from the prefix cache; every rule
        removes through here.

        Returns:
            True if the entry was still cached (False: its block was evicted,
            and possibly cached again under an equal hash, since).

        """
        return self.kv_cache_manager.block_pool.remove_uncommitted_entry(entry)

    def _remove_step(self, entries: StepCacheEntries) -> None:
        for req_id, req_entries in entries.items():
            self.remove_entries(req_id, req_entries)
        entries.clear()
