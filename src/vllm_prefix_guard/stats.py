"""Counters an operator can read: what the guard tracked, rolled back, and why.

Nothing here runs on the step path: a :class:`StatsPublisher` thread copies a guard's
:class:`GuardStats` into JSON files (``/metrics``' and the operator's) when they changed.
Nothing that only reports may take the engine down: a failed write is logged once and skipped.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger
from vllm_prefix_guard.metrics import ROLLBACK_CAUSES

#: An operator's JSON copy of the counters; ``{engine}`` in it becomes the engine's
#: data-parallel rank, else engines past the first get ``.engine<N>`` (never a shared file).
STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"


@dataclass
class GuardStats:
    """Counters of one scheduler's guard (meanings: ``metrics.COUNTERS``). Entries are
    (block hash key, block id) pairs."""

    steps_committed: int = 0  # by update_from_output
    registrations_tracked: int = 0  # speculative registrations, made inside allocate_slots
    # Entries removed because their request was preempted in the same schedule() call, the
    # step reported their KV load failed, or their step's output was dropped.
    rolled_back_preempted: int = 0
    rolled_back_kv_load_failure: int = 0
    rolled_back_dropped_step: int = 0
    stale_entries_skipped: int = 0  # at rollback: the block was evicted or re-keyed since
    dependents_preempted: int = 0
    peak_uncommitted_entries: int = 0  # most entries held uncommitted at once

    @property
    def rolled_back(self) -> int:
        return sum(getattr(self, field) for field in ROLLBACK_CAUSES.values())

    def as_dict(self) -> dict[str, int]:
        return {**dataclasses.asdict(self), "rolled_back": self.rolled_back}


def stats_file_path(template: str, engine: int, engines: int) -> str:
    """Where engine ``engine`` of ``engines`` writes the operator's stats file."""
    if "{engine}" in template:
        return template.replace("{engine}", str(engine))
    if engines <= 1 and engine == 0:
        return template
    path = Path(template)
    return str(path.with_name(f"{path.stem}.engine{engine}{path.suffix}"))


def check_stats_file_setting() -> str | None:
    """The operator's stats-file template, if set.

    Raises:
        GuardConfigError: the path is a directory, or its directory is missing or not
            writable (at start-up, so a typo fails the start instead of the first write).
    """
    template = os.environ.get(STATS_FILE_ENV, "").strip()
    if not template:
        return None
    path = os.path.abspath(template.replace("{engine}", "0"))
    if os.path.isdir(path):
        raise GuardConfigError(
            f"{STATS_FILE_ENV}={template!r}: {path!r} is a directory; name a file in it "
            f"(e.g. {os.path.join(template, 'prefix-guard-{engine}.json')!r})."
        )
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        raise GuardConfigError(
            f"{STATS_FILE_ENV}={template!r}: the directory {directory!r} does not exist. "
            f"Create it, or unset {STATS_FILE_ENV}."
        )
    if not os.access(directory, os.W_OK):
        raise GuardConfigError(
            f"{STATS_FILE_ENV}={template!r}: the directory {directory!r} is not writable."
        )
    return template


def write_json_atomically(path: str, document: dict[str, object]) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(document, fh)
    os.replace(partial, path)


class StatsPublisher:
    """Keeps ``paths`` (and ``export``) holding an engine's latest counters from a daemon
    thread: every ``interval_s`` it reads them (integer loads; the engine runs on) and, only
    if they changed, rewrites each file atomically, stamped with the time. :meth:`close`
    writes once more, so a burst's last counters are never lost. A file that fails is
    logged once and skipped from then on; an export that fails, likewise."""

    def __init__(
        self,
        read: Callable[[], dict[str, int] | None],
        paths: Sequence[str],
        labels: dict[str, str],
        interval_s: float = 1.0,
        export: Callable[[dict[str, int]], None] | None = None,
    ) -> None:
        self._read = read
        self._export = export
        self._paths = list(paths)
        self._labels = dict(labels)
        self._interval_s = interval_s
        self._last: dict[str, int] | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="vllm-prefix-guard-stats", daemon=True
        )

    @property
    def paths(self) -> list[str]:
        return list(self._paths)

    def start(self) -> None:
        self._thread.start()

    def publish(self, force: bool = False) -> bool:
        """Write the counters if they changed since the last write (or ``force``); False
        once they are gone (their scheduler was collected)."""
        with self._lock:
            counters = self._read()
            if counters is None:
                return False
            if counters == self._last and not force:
                return True
            document = {**self._labels, "pid": os.getpid(), "updated_at": time.time()}
            document["counters"] = counters
            for path in list(self._paths):
                try:
                    write_json_atomically(path, document)
                except OSError as exc:
                    self._paths.remove(path)
                    logger().warning(
                        "vllm-prefix-guard: cannot write the counters to %s (%s); that file "
                        "will not be updated again. Serving continues.",
                        path,
                        exc,
                    )
            if self._export is not None:
                try:
                    self._export(counters)
                except Exception as exc:  # reporting only: never again, serving goes on
                    self._export = None
                    logger().warning(
                        "vllm-prefix-guard: cannot export the counters to /metrics (%s); "
                        "serving continues.",
                        exc,
                    )
            self._last = counters
            return True

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self.publish(force=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if not self.publish():
                    return
            except Exception:  # pragma: no cover - reporting never raises into vLLM
                logger().exception("vllm-prefix-guard: publishing the counters failed")
                return
