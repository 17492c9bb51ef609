"""The bounded-exhaustive search: depth-first over every step a scope allows, by fork.

The process holding a state is the snapshot its branches start from: for every choice
but the last it forks, the child applies the choice and goes on from there, and the
parent waits for it; the parent then takes the last choice itself. Each iteration
branches twice, on its events and, once ``schedule()`` has shown what the new step
loads, on which loads fail and whether the oldest step is dropped.

After each iteration the state's digest (``System.digest``: every lane's scheduler,
pool, guard records and shadow KV, plus the iteration, so equal digests also have equal
budgets left) goes into the shared :class:`VisitedTable`; a state seen before is not
explored again. Children report by appending JSON lines to one file (``O_APPEND``):
each lane's first bad read on a path, with the path; every path on which stock read no
bad KV and the guard's hit tokens differ from stock's; errors.

Pinned hash seed: vLLM's scheduling order follows ``PYTHONHASHSEED`` (``fuzz.hash_seed``).
"""

from __future__ import annotations

import fcntl
import gc
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from vllm_prefix_guard_harness.explore.scope import Scope
from vllm_prefix_guard_harness.explore.system import (
    Events,
    Outcome,
    Path,
    Step,
    System,
)
from vllm_prefix_guard_harness.explore.visited import VisitedTable
from vllm_prefix_guard_harness.fuzz.runner import plugin_restored

T = TypeVar("T")


@dataclass
class Finding:
    """A lane's first bad read on a path (``kind="violation"``), a path where the guard's
    hits differ from clean stock's (``"hit_gap"``; ``"hit_gap_reordered"`` where they
    are above stock's and the guard rolled entries back on the path: explained, see
    ``System.guard_rolled_back``), or an error."""

    kind: str
    lane: str
    path: Path
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class SearchResult:
    scope: Scope
    modes: tuple[str, ...]
    counters: dict[str, int]
    seconds: float
    findings: list[Finding]

    def of(self, kind: str, lane: str | None = None) -> list[Finding]:
        return [f for f in self.findings if f.kind == kind and (lane is None or f.lane == lane)]

    def violations(self, lane: str) -> int:
        """Transitions on which ``lane`` read bad KV for the first time on its path."""
        return len(self.of("violation", lane))

    def events_wrong(self, lane: str) -> int:
        """Transitions after which a KV-event consumer of ``lane`` (a set of keys, or a
        count per key) disagreed with its pool for the first time on its path."""
        return len(self.of("kv_events", lane))

    def shortest(self, kind: str, lane: str | None = None) -> Finding | None:
        found = self.of(kind, lane)
        return min(found, key=lambda f: (len(f.path), repr(f.path))) if found else None

    @property
    def complete(self) -> bool:
        """Every state within the bounds explored: no run left undrained, no error."""
        return not self.counters["unfinished"] and not self.counters["errors"]


class Search:
    """One scope, one set of lanes; :meth:`run` explores it completely."""

    def __init__(self, scope: Scope, modes: tuple[str, ...], slots: int = 1 << 21) -> None:
        self.scope = scope
        self.modes = modes
        self.slots = slots
        # A lane that read bad KV is followed on only while another lane is still clean.
        self.table: VisitedTable
        self.log_fd = -1
        self.root_pid = os.getpid()

    def run(self) -> SearchResult:
        started = time.perf_counter()
        self.table = VisitedTable(self.slots)
        with tempfile.TemporaryFile("w+b") as log, plugin_restored():
            self.log_fd = os.dup(log.fileno())
            fcntl.fcntl(self.log_fd, fcntl.F_SETFL, os.O_WRONLY | os.O_APPEND)
            try:
                system = System.build(self.scope, self.modes)
                self.table.insert(system.digest())
                sys.stdout.flush()
                sys.stderr.flush()
                gc.collect()
                gc.freeze()  # objects already built stay shared with the children
                self._node(system, ())
            finally:
                gc.unfreeze()
                os.close(self.log_fd)
            log.seek(0)
            findings = [_finding(json.loads(line)) for line in log.read().splitlines()]
        counters = self.table.counters()
        self.table.close()
        return SearchResult(
            self.scope, self.modes, counters, time.perf_counter() - started, findings
        )

    # -- the walk ----------------------------------------------------------------------

    def _node(self, system: System, path: Path) -> None:
        """Explore every continuation of ``system`` (at the start of an iteration)."""
        if system.done:
            self._complete(system, path)
            return
        if system.iteration >= self.scope.max_iterations:
            self.table.add("unfinished")
            self._log("unfinished", "", path, {})
            return
        self._branch(
            system.event_options(), lambda events: self._after_events(system, path, events)
        )

    def _after_events(self, system: System, path: Path, events: Events) -> None:
        system.begin(events)
        self._branch(
            system.outcome_options(),
            lambda outcome: self._after_outcome(system, path, Step(events, outcome)),
        )

    def _after_outcome(self, system: System, path: Path, step: Step) -> None:
        outcome: Outcome = step.outcome
        first_bad = system.finish(outcome)
        path = (*path, step)
        self.table.add("transitions")
        for index in first_bad:
            lane = system.lanes[index]
            counts = dict(lane.driver.kv.counts)
            examples = [
                [v.step, v.request_id, v.position, v.block_id, v.kind]
                for v in lane.driver.kv.violations[:3]
            ]
            self._log("violation", lane.mode, path, {"counts": counts, "examples": examples})
        for index in system.first_events_wrong:
            events = system.lanes[index].driver.events
            assert events is not None  # only a lane with KV events can disagree
            wrong = {
                "set": [events.missing, events.extra],
                "counting": [events.counted_missing, events.counted_extra],
            }
            self._log("kv_events", system.lanes[index].mode, path, {"keys_wrong": wrong})
        if all(system.dirty):
            self.table.add("cut")
            return
        if self.table.insert(system.digest()):
            self.table.raise_to("max_depth", len(path))
            self._node(system, path)

    def _complete(self, system: System, path: Path) -> None:
        self.table.add("complete_paths")
        if any(lane.released for lane in system.lanes):
            self.table.add("wedged_paths")
        gap = system.hit_gap()
        if gap is None:
            return
        self.table.add("compared_paths")
        if gap:
            hits = {lane.mode: lane.hit_tokens for lane in system.lanes}
            kind = "hit_gap_reordered" if gap > 0 and system.guard_rolled_back() else "hit_gap"
            self._log(kind, "guard", path, {"gap": gap, "hits": hits})

    def _branch(self, options: Sequence[T], go: Callable[[T], None]) -> None:
        """``go(option)`` for each option, each in a fork but the last (in this process)."""
        for option in options[:-1]:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    go(option)
                except BaseException:
                    code = 1
                    self.table.add("errors")
                    self._log("error", "", (), {"traceback": traceback.format_exc()})
                finally:
                    os._exit(code)
            os.waitpid(pid, 0)
        go(options[-1])

    def _log(self, kind: str, lane: str, path: Path, detail: dict[str, Any]) -> None:
        record = {"kind": kind, "lane": lane, "path": [s.to_json() for s in path], **detail}
        os.write(self.log_fd, (json.dumps(record) + "\n").encode())


def _finding(record: dict[str, Any]) -> Finding:
    kind, lane = record.pop("kind"), record.pop("lane")
    path = tuple(Step.from_json(s) for s in record.pop("path"))
    return Finding(kind, lane, path, record)


def explore(scope: Scope, modes: tuple[str, ...], slots: int = 1 << 21) -> SearchResult:
    """Explore ``scope`` completely with one lane per mode (stock, guard, mutations)."""
    return Search(scope, modes, slots).run()
