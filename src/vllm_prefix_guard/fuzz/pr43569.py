"""The rollback scope of upstream PR #43569, as a comparator for the differential fuzzer.

PR #43569 ("Roll back eager prefix-cache registration on uncommitted free") keeps one
bucket per in-flight step, like the guard, but on preemption rolls the victim back in
*every* bucket. The guard rolls back the open bucket only: a dispatched step cannot be
cancelled and writes its blocks, so its entries are valid and undoing them only costs
hits (and, through recomputation, preemptions). This module measures that cost instead
of asserting it.

It changes one guard ledger, not vLLM: the ledger's ``rollback_preempted`` is rebound on
that instance so the victim's entries in dispatched buckets go too. Everything else
(KV-load failures, dropped steps, reset) stays the guard's, so the comparison isolates
the rollback scope. With one step in flight at most (synchronous engine) nothing is
dispatched when ``schedule()`` runs and the two policies coincide.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

from vllm_prefix_guard.ledger import StepLedger


@dataclass
class InFlightRollbacks:
    """Entries the wider scope removed from dispatched (already running) steps."""

    entries: int = 0
    requests: int = 0


def adopt_pr43569_scope(ledger: StepLedger) -> InFlightRollbacks:
    """Make ``ledger`` roll preemption victims back in every in-flight bucket.

    Entries undone in dispatched buckets count in ``ledger.stats.rolled_back_preempted``
    (as they would in the PR) and, separately, in the returned counters. They are not
    added to ``contested_blocks``: the PR does not withdraw readers, and such a block is
    written anyway.
    """
    counters = InFlightRollbacks()
    open_bucket_only = ledger.rollback_preempted

    def rollback_preempted(self: StepLedger, request_id: str) -> None:
        open_bucket_only(request_id)
        undone = 0
        for _, bucket in self._dispatched.values():
            # Unregister, but keep the entries: a KV-load failure reported later for
            # this step must still find them (see the module docstring).
            entries = bucket.by_request.get(request_id)
            if entries:
                undone += self._undo(entries)
        if undone:
            self.stats.rolled_back_preempted += undone
            counters.entries += undone
            counters.requests += 1

    ledger.rollback_preempted = types.MethodType(  # type: ignore[method-assign]
        rollback_preempted, ledger
    )
    return counters
