"""Counters an operator can read: what the guard tracked, rolled back, and why.

Each scheduler's ledger owns one :class:`GuardStats`. Nothing here logs per step: the
EngineCore prints one summary line at shutdown (see ``hooks``), and :class:`StatsFile`
keeps a JSON copy fresh for tooling (vLLM's default ``--shutdown-timeout 0`` can kill
EngineCore before shutdown).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class GuardStats:
    """Counters of one scheduler's ledger. Entries are (block hash key, block id) pairs."""

    # Steps whose registrations were committed by update_from_output.
    steps_committed: int = 0
    # Speculative registrations recorded (made inside allocate_slots).
    registrations_tracked: int = 0
    # Entries removed because their request was preempted in the same schedule() call.
    rolled_back_preempted: int = 0
    # Entries removed because the step reported their KV load as failed.
    rolled_back_kv_load_failure: int = 0
    # Entries removed because their step never came back (its output was dropped).
    rolled_back_dropped_step: int = 0
    # Entries skipped at rollback because the block was evicted or re-keyed since.
    stale_entries_skipped: int = 0
    # Requests preempted because they counted a rolled-back block as computed.
    dependents_preempted: int = 0
    # Largest number of entries held uncommitted at once (steps in flight).
    peak_uncommitted_entries: int = 0

    @property
    def rolled_back(self) -> int:
        return (
            self.rolled_back_preempted
            + self.rolled_back_kv_load_failure
            + self.rolled_back_dropped_step
        )

    def as_dict(self) -> dict[str, int]:
        out = dataclasses.asdict(self)
        out["rolled_back"] = self.rolled_back
        return out


class StatsFile:
    """Keeps ``path`` holding the latest counters as JSON, rewritten at most every
    ``interval_s`` seconds (one clock read per step in between), atomically."""

    def __init__(self, path: str, interval_s: float = 2.0) -> None:
        self.path = path
        self.interval_s = interval_s
        self._next_write = 0.0

    def maybe_write(self, counters: Callable[[], dict[str, int]]) -> None:
        if time.monotonic() >= self._next_write:
            self.write(counters())

    def write(self, counters: dict[str, int]) -> None:
        self._next_write = time.monotonic() + self.interval_s
        partial = f"{self.path}.{os.getpid()}.tmp"
        with open(partial, "w", encoding="utf-8") as fh:
            json.dump(counters, fh)
        os.replace(partial, self.path)
