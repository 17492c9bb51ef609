"""Shrink a workload that reads bad KV to a minimal one that still does.

Hand-rolled delta debugging over :class:`Workload` events (a workload is plain data, so
no generator needs to be replayed, and the result prints as a paste-able test):

1. cut every event after the iteration of the first bad read (nothing later can
   matter), and stop each trial run at its first bad read;
2. ``ddmin`` over requests (an arrival together with its aborts) and resets, then over
   the remaining aborts;
3. simplify what is left, one field at a time: fewer output tokens, shorter or fewer
   prompt runs, priority 0, no remote tokens;
4. start at iteration 0 and renumber token runs and request ids compactly.

Every candidate is kept only if it still reads bad KV in the same mode, so the result
reproduces by construction; when the budget allows, it is 1-minimal with respect to
removing one request.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from vllm_prefix_guard_harness.fuzz.runner import run_workload
from vllm_prefix_guard_harness.fuzz.workload import (
    Abort,
    Arrive,
    Event,
    Fault,
    Reset,
    Runs,
    Workload,
)

T = TypeVar("T")
Predicate = Callable[[Workload], bool]


def reads_bad_kv(mode: str) -> Predicate:
    """Whether a workload reads bad KV in ``mode``."""

    def predicate(workload: Workload) -> bool:
        return run_workload(workload, mode, stop_on_violation=True).violations > 0

    return predicate


def rolls_back_valid_kv(mode: str = "guard") -> Predicate:
    """Whether the rollback audit finds valid KV or state rolled back in ``mode`` (a
    precision finding: nothing bad is read, so only this predicate can shrink it)."""

    def predicate(workload: Workload) -> bool:
        audit = run_workload(workload, mode, audit=True).audit
        return audit is not None and audit.valid_rolled_back > 0

    return predicate


class Budget:
    """A deadline for a shrink."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    @property
    def spent(self) -> bool:
        return time.monotonic() >= self.deadline


def ddmin(items: Sequence[T], test: Callable[[list[T]], bool], budget: Budget) -> list[T]:
    """Zeller's delta debugging, complement-only: a 1-minimal sublist passing ``test``."""
    kept = list(items)
    chunks = 2
    while len(kept) >= 2 and not budget.spent:
        size = -(-len(kept) // chunks)
        for start in range(0, len(kept), size):
            candidate = kept[:start] + kept[start + size :]
            if test(candidate):
                kept = candidate
                chunks = max(chunks - 1, 2)
                break
        else:
            if chunks >= len(kept):
                break
            chunks = min(len(kept), chunks * 2)
    if len(kept) == 1 and test([]):
        return []
    return kept


def shrink(
    workload: Workload,
    mode: str,
    *,
    seconds: float = 60.0,
    predicate: Predicate | None = None,
) -> Workload:
    """A small workload that, like ``workload``, reads bad KV in ``mode`` (or satisfies
    ``predicate``).

    Args:
        seconds: time budget; the best workload found so far is returned when it runs out.
        predicate: what must keep holding (default: reads bad KV in ``mode``); it need
            not involve a bad read (``rolls_back_valid_kv``).

    Raises:
        ValueError: ``workload`` does not satisfy the predicate to begin with.
    """
    holds = predicate or reads_bad_kv(mode)
    budget = Budget(seconds)
    first = run_workload(workload, mode, stop_on_violation=True).first_violation_iteration
    if (first is None and predicate is None) or not holds(workload):
        what = "reads no bad KV" if predicate is None else "does not satisfy the predicate"
        raise ValueError(f"the workload {what} in mode {mode!r}")
    best = workload
    if first is not None:
        truncated = workload.replace([e for e in workload.events if e.step <= first])
        if holds(truncated):
            best = truncated

    def attempt(candidate: Workload) -> bool:
        nonlocal best
        candidate = candidate.with_consistent_events()
        if candidate.events != best.events and holds(candidate):
            best = candidate
            return True
        return False

    # Requests (with their aborts) and resets, then single aborts.
    units = _units(best)
    kept = ddmin(units, lambda c: attempt(best.replace([e for unit in c for e in unit])), budget)
    best = best.replace([e for unit in kept for e in unit])
    aborts = [e for e in best.events if isinstance(e, Abort)]
    others = [e for e in best.events if not isinstance(e, Abort)]
    kept_aborts = ddmin(aborts, lambda c: attempt(best.replace([*others, *c])), budget)
    best = best.replace([*others, *kept_aborts])

    for index in range(len(best.events)):
        if budget.spent:
            break
        for simpler in _simplifications(best.events[index]):
            if attempt(best.replace([*best.events[:index], simpler, *best.events[index + 1 :]])):
                break

    for tidy in (_start_at_zero, _renumber_runs, _renumber_requests):
        attempt(tidy(best))
    return best


def _units(workload: Workload) -> list[list[Event]]:
    aborts: dict[str, list[Event]] = {}
    for event in workload.events:
        if isinstance(event, Abort):
            aborts.setdefault(event.request_id, []).append(event)
    units: list[list[Event]] = []
    for event in workload.events:
        if isinstance(event, Arrive):
            units.append([event, *aborts.get(event.request_id, [])])
        elif isinstance(event, (Reset, Fault)):
            units.append([event])
    return units


def _simplifications(event: Event) -> list[Event]:
    """Simpler variants of one event, most aggressive first."""
    if not isinstance(event, Arrive):
        return [dataclasses.replace(event, running=False)] if isinstance(event, Reset) else []
    out: list[Event] = []
    if event.max_tokens > 1:
        out += [dataclasses.replace(event, max_tokens=n) for n in (1, event.max_tokens // 2)]
    if event.priority:
        out.append(dataclasses.replace(event, priority=0))
    if event.external_tokens:
        out.append(
            dataclasses.replace(
                event, external_tokens=0, fail_load=False, failed_blocks=(), async_load_steps=0
            )
        )
    if event.async_load_steps > 1:
        out.append(dataclasses.replace(event, async_load_steps=1))
    prompt = event.prompt
    if len(prompt) > 1:
        out.append(dataclasses.replace(event, prompt=prompt[:-1]))
        out.append(dataclasses.replace(event, prompt=prompt[1:]))
    first, length = prompt[-1]
    for shorter in (length // 2, length - 1):
        if 0 < shorter < length:
            out.append(dataclasses.replace(event, prompt=(*prompt[:-1], (first, shorter))))
    return out


def _start_at_zero(workload: Workload) -> Workload:
    offset = workload.events[0].step if workload.events else 0
    return workload.replace([dataclasses.replace(e, step=e.step - offset) for e in workload.events])


def _renumber_runs(workload: Workload) -> Workload:
    """Map each distinct run start to 1000, 2000, ... (runs are shorter than 1000)."""
    starts: dict[int, int] = {}
    for event in workload.events:
        if isinstance(event, Arrive):
            for first, _ in event.prompt:
                starts.setdefault(first, 1000 * (len(starts) + 1))
    if any(length >= 1000 for e in workload.arrivals for _, length in e.prompt):
        return workload

    def renumber(prompt: Runs) -> Runs:
        return tuple((starts[first], length) for first, length in prompt)

    return workload.replace(
        [
            dataclasses.replace(e, prompt=renumber(e.prompt)) if isinstance(e, Arrive) else e
            for e in workload.events
        ]
    )


def _renumber_requests(workload: Workload) -> Workload:
    names: dict[str, str] = {}
    for arrival in workload.arrivals:
        names[arrival.request_id] = f"r{len(names)}"
    return workload.replace(
        [
            dataclasses.replace(e, request_id=names[e.request_id])
            if isinstance(e, Arrive | Abort)
            else e
            for e in workload.events
        ]
    )
