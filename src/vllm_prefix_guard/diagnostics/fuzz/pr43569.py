"""The rollback scope of upstream PR #43569, as a comparator for the differential fuzzer.

PR #43569 ("Roll back eager prefix-cache registration on uncommitted free") keeps one
bucket per in-flight step, like the guard, but on preemption rolls the victim back in
*every* bucket. The guard rolls back the open bucket only: a dispatched step cannot be
cancelled and writes its blocks, so its entries are valid and undoing them only costs
hits (and, through recomputation, preemptions). This module measures that cost instead
of asserting it.

It plugs into one guard ledger through the ledger's public :class:`PreemptionScope`
policy; everything else (KV-load failures, dropped steps, reset) stays the guard's, so
the comparison isolates the rollback scope. With one step in flight at most
(synchronous engine) nothing is dispatched when ``schedule()`` runs and the two
policies coincide.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_prefix_guard.ledger import StepLedger

#: How diagnostics name the in-flight entries this scope undoes.
PREEMPTED_IN_FLIGHT = "preempted (in flight, pr43569)"


@dataclass
class EveryStepInFlight:
    """Preemption scope that also unregisters the victim's entries in dispatched steps.

    The entries stay in their buckets: a KV-load failure reported later for such a step
    must still find them (see the module docstring). They are not contested either: the
    PR does not withdraw readers, and such a block is written anyway. What this scope
    removed from dispatched (already running) steps is counted here and in the ledger's
    ``rolled_back_preempted``, as the PR would.
    """

    entries: int = 0
    requests: int = 0

    def after_open_step_rollback(self, ledger: StepLedger, request_id: str) -> None:
        undone = 0
        for bucket in ledger.in_flight_buckets():
            entries = bucket.by_request.get(request_id)
            if entries:
                undone += ledger.unregister(entries, PREEMPTED_IN_FLIGHT, request_id)
        if undone:
            ledger.stats.rolled_back_preempted += undone
            self.entries += undone
            self.requests += 1


def adopt_pr43569_scope(ledger: StepLedger) -> EveryStepInFlight:
    """Make ``ledger`` roll preemption victims back in every in-flight bucket; return the
    counters of what that removed from steps in flight."""
    scope = EveryStepInFlight()
    ledger.preemption_scope = scope
    return scope
