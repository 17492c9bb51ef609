"""The check the demo and the server test make: every completion of the guarded server must
equal what a server without prefix caching returns for the same request.

The guarded pass is timed, with cancellations, to provoke preemptions; the reference pass
replays the requests that completed, all at once and never cancelled, since only its results
matter. Both passes are greedy, so each request has exactly one right answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from guard_demo.compare import Completion, find_mismatches
from guard_demo.metrics import MetricsSnapshot
from guard_demo.workload import Outcome, WorkItem, run_workload

__all__ = ["ReferenceCheck", "check_against_reference"]


@dataclass(frozen=True)
class ReferenceCheck:
    """What the two passes did, and where they differ."""

    #: The guarded server's outcomes, in workload order.
    outcomes: list[Outcome]
    #: The reference server's outcomes for the completed requests, in the same order.
    replayed: list[Outcome]
    #: The guarded server's counters over its pass.
    metrics: MetricsSnapshot
    #: First difference of each completion that differs from the reference, by request id.
    mismatches: dict[str, str]

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "completed"]

    @property
    def cancelled(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "cancelled"]

    @property
    def failures(self) -> list[Outcome]:
        """Failed requests of either pass: a failed replay is a failure, not a mismatch."""
        return [o for o in self.outcomes + self.replayed if o.status == "failed"]


def check_against_reference(
    guarded_url: str,
    reference_url: str,
    items: Sequence[WorkItem],
    *,
    concurrency: int = 32,
    timeout_s: float = 600.0,
    show_progress: bool = False,
) -> ReferenceCheck:
    """Run ``items`` on the guarded server, replay the completed ones on the reference server,
    and compare. ``timeout_s`` applies to each pass (see :func:`run_workload`)."""
    before = MetricsSnapshot.scrape(guarded_url)
    outcomes = run_workload(
        guarded_url,
        items,
        concurrency=concurrency,
        timeout_s=timeout_s,
        desc="workload (guarded server)" if show_progress else None,
    )
    metrics = MetricsSnapshot.scrape(guarded_url) - before
    completed = [o for o in outcomes if o.status == "completed"]
    replayed = run_workload(
        reference_url,
        [o.item for o in completed],
        replay=True,
        concurrency=concurrency,
        timeout_s=timeout_s,
        desc="reference (no prefix caching)" if show_progress else None,
    )
    mismatches = find_mismatches(_by_request_id(completed), _by_request_id(replayed))
    return ReferenceCheck(outcomes, replayed, metrics, mismatches)


def _by_request_id(outcomes: Sequence[Outcome]) -> dict[str, Completion]:
    return {o.item.request_id: o.completion for o in outcomes if o.completion is not None}
