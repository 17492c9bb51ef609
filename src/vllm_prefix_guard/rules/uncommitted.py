# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries of scheduler steps whose KV is not written yet.

`KVCacheManager.allocate_slots` registers the blocks a step is about to
compute, so that requests in the same batch can share them. Until the step's
output comes back its entries are *uncommitted*; one whose KV is never written
is a wrong answer for every later hit. The rules remove exactly those:

1. A request preempted inside `schedule()` (priority policy) never runs the
   step being scheduled: its entries of that step go before its blocks are
   freed, but for tokens below its computed tokens, which a dispatched step
   writes (dispatched steps are never cancelled).
2. A step whose output never comes back (a later step commits first) wrote
   nothing: its entries go when the later step commits.
3. vLLM's fault tolerance resumes the engine loop after a fault: the entries
   of a `schedule()` that raised go when the next step begins, and (rule 4)
   those of the steps in flight when it finishes every request at once, as
   none of them comes back.

NOTE: Same-step sharing needs no rule: lookups run only in the waiting loop of
`schedule()`, which is skipped once the running loop preempted a request.

Cost: O(1) per step and per registration; a removal is O(entries removed).
"""

from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_prefix_guard.rules.block_pool import StepCacheEntries, UncommittedEntry


def split_written(
    entries: list[UncommittedEntry], num_tokens: int
) -> tuple[list[UncommittedEntry], list[UncommittedEntry]]:
    """(The entries whose tokens all lie below `num_tokens`, the others)."""
    written: list[UncommittedEntry] = []
    unwritten: list[UncommittedEntry] = []
    for entry in entries:
        below = entry[2] is not None and 0 < entry[2] <= num_tokens
        (written if below else unwritten).append(entry)
    return written, unwritten


def keep_entries(
    entries: StepCacheEntries, req_id: str | None, kept: list[UncommittedEntry]
) -> None:
    """Put (back) entries of `req_id` into a step's record."""
    if kept:
        entries.setdefault(req_id, []).extend(kept)


class UncommittedPrefixCache:
    """The uncommitted prefix-cache entries of each scheduler step, in order.

    `begin_step` opens a record, to which the block pool appends every new
    entry; `end_step` ties it to the `SchedulerOutput` that `schedule()`
    returns, the only thing `update_from_output` receives that names the step
    (the record holds the output, so its id is not reused while in flight).
    Every removal goes through `remove_entry`.
    """

    def __init__(self, kv_cache_manager: KVCacheManager) -> None:
        self.kv_cache_manager = kv_cache_manager
        # id(SchedulerOutput) -> (output, its entries), oldest first.
        self.step_id_to_entries: dict[
            int, tuple[SchedulerOutput, StepCacheEntries]
        ] = {}

    def steps_in_flight(self) -> list[tuple[SchedulerOutput, StepCacheEntries]]:
        """The steps dispatched and not committed, oldest first."""
        return list(self.step_id_to_entries.values())

    def begin_step(self) -> None:
        """Record the new prefix-cache entries of the step being scheduled."""
        block_pool = self.kv_cache_manager.block_pool
        if block_pool.uncommitted_entries is not None:
            self._remove_step(block_pool.uncommitted_entries)  # Rule 3.
        block_pool.uncommitted_entries = {}

    def end_step(self, scheduler_output: SchedulerOutput) -> None:
        """Stop recording; the entries await the output of `scheduler_output`."""
        block_pool = self.kv_cache_manager.block_pool
        entries = block_pool.uncommitted_entries
        assert entries is not None, "end_step() without begin_step()"
        block_pool.uncommitted_entries = None
        self.step_id_to_entries[id(scheduler_output)] = (scheduler_output, entries)

    def commit_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step of `scheduler_output` ran: its entries are valid, and those
        of older steps still in flight never will be. An output `schedule()`
        did not produce (`EngineCore` passes an empty one while it drains)
        commits nothing."""
        step_id = id(scheduler_output)
        while step_id in self.step_id_to_entries:
            oldest_id = next(iter(self.step_id_to_entries))
            _, entries = self.step_id_to_entries.pop(oldest_id)
            if oldest_id != step_id:
                self._remove_step(entries)

    def drop_steps_in_flight(self) -> None:
        """Remove the entries of every step in flight, newest first (rule 4)."""
        while self.step_id_to_entries:
            self._remove_step(self.step_id_to_entries.popitem()[1][1])

    def reset(self) -> None:
        """`reset_prefix_cache` removed every entry: forget the records."""
        self.step_id_to_entries.clear()
        if self.kv_cache_manager.block_pool.uncommitted_entries is not None:
            self.kv_cache_manager.block_pool.uncommitted_entries = {}

    def rollback_preempted(self, req_id: str, num_written_tokens: int) -> None:
        """Remove the open step's entries of a request preempted inside
        `schedule()`, before its blocks are freed; those below its
        `num_written_tokens` (computed before this step) move to the latest
        step in flight, which writes them."""
        open_entries = self.kv_cache_manager.block_pool.uncommitted_entries
        if open_entries is None:
            return
        entries = open_entries.pop(req_id, [])
        if entries and num_written_tokens:
            written, entries = split_written(entries, num_written_tokens)
            if self.step_id_to_entries:
                _, latest = next(reversed(self.step_id_to_entries.values()))
                keep_entries(latest, req_id, written)
        self.remove_entries(req_id, entries)

    def remove_entries(
        self, req_id: str | None, entries: list[UncommittedEntry]
    ) -> None:
        """Remove entries of `req_id` from the prefix cache, newest first."""
        for entry in reversed(entries):
            self.remove_entry(req_id, entry)

    def remove_entry(self, req_id: str | None, entry: UncommittedEntry) -> bool:
        """Remove one entry of `req_id`; False if it was no longer cached."""
        return self.kv_cache_manager.block_pool.remove_uncommitted_entry(entry)

    def _remove_step(self, entries: StepCacheEntries) -> None:
        for req_id, req_entries in entries.items():
            self.remove_entries(req_id, req_entries)
