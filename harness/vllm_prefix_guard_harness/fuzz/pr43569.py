"""The rollback scope of upstream PR #43569, as a comparator for the differential fuzzer.

PR #43569 ("Roll back eager prefix-cache registration on uncommitted free") keeps one
record per in-flight step, like the guard, but on preemption rolls the victim back in
*every* record. The guard rolls back the open step only: a dispatched step cannot be
cancelled and writes its blocks, so its entries are valid and removing them only costs
hits (and, through recomputation, preemptions). This module measures that cost instead
of asserting it.

:class:`EveryStepInFlight` is the guard's rules with that one rule widened (a policy of
its own, run as the fuzzer's ``pr43569`` mode); everything else (KV-load failures,
dropped steps, reset) stays the guard's, so the comparison isolates the rollback scope.
With one step in flight at most (synchronous engine) nothing is dispatched when
``schedule()`` runs and the two policies coincide.
"""

from __future__ import annotations

from typing import Any

from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache


class EveryStepInFlight(UncommittedPrefixCache):
    """The guard's rules, where a preemption also removes the victim's entries of the
    steps in flight.

    Those entries stay in their records: a KV-load failure reported later for such a
    step must still find them. What it removed from dispatched (already running) steps
    is counted here, and in the guard's ``rolled_back_preempted`` as the PR would.
    """

    def __init__(self, kv_cache_manager: Any) -> None:
        super().__init__(kv_cache_manager)
        self.entries = 0
        self.requests = 0

    def rollback_preempted(self, req_id: str, num_written_tokens: int) -> None:
        # Like the guard's rule, it acts on preemptions inside schedule() only.
        inside_schedule = self.kv_cache_manager.block_pool.uncommitted_entries is not None
        super().rollback_preempted(req_id, num_written_tokens)
        if not inside_schedule:
            return
        removed = 0
        for _, entries in self.steps_in_flight():
            for entry in reversed(entries.get(req_id, ())):
                removed += self.remove_entry(req_id, entry)
        if removed:
            self.entries += removed
            self.requests += 1
