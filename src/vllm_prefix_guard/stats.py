"""Counters an operator can read: what the guard tracked, rolled back, and why.

Each scheduler's guard owns one :class:`GuardStats`. Nothing here runs on the step path:
a :class:`StatsPublisher` thread copies the counters into JSON files when they changed
(checked once a second) and once more when the scheduler shuts down. Those files feed
``/metrics`` (:mod:`vllm_prefix_guard.metrics`) and, if the operator asks for one with
``VLLM_PREFIX_GUARD_STATS_FILE``, their own tooling. Nothing that only reports may take
the engine down: a write that fails is logged once and skipped.
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
from typing import Any

from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger

#: An operator's JSON copy of the counters; ``{engine}`` in it becomes the engine's index
#: (data-parallel rank). Without it, engines beyond the first get ``.engine<N>`` before
#: the file's extension, so two engines never share a file.
STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"


@dataclass
class GuardStats:
    """Counters of one scheduler's guard. Entries are (block hash key, block id) pairs."""

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
    # Requests made to recompute because they computed over a rolled-back block:
    # preempted by the guard, or preempted by vLLM already and their output in flight
    # dropped.
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


def stats_file_path(template: str, engine: int, engines: int) -> str:
    """Where engine ``engine`` of ``engines`` writes the operator's stats file."""
    if "{engine}" in template:
        return template.replace("{engine}", str(engine))
    if engines <= 1 and engine == 0:
        return template
    path = Path(template)
    return str(path.with_name(f"{path.stem}.engine{engine}{path.suffix}"))


def check_stats_file_setting() -> str | None:
    """The operator's stats-file template, if set; its directory must exist and be writable.

    Raises:
        GuardConfigError: the path is a directory, or its directory is missing or not
            writable (checked at start-up, so a typo fails the server's start instead of
            the first write).
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


def write_json_atomically(path: str, document: dict[str, Any]) -> None:
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w", encoding="utf-8") as fh:
        json.dump(document, fh)
    os.replace(partial, path)


class StatsPublisher:
    """Keeps ``paths`` (and ``export``, if given) holding an engine's latest counters, off
    the scheduler's thread.

    A daemon thread wakes every ``interval_s``, reads the counters (a handful of integer
    loads; the engine thread keeps running) and rewrites the files only when they changed,
    each atomically and stamped with the time. :meth:`close` writes once more, so the last
    counters of a burst are never lost. An I/O error is logged once per file and the file
    skipped from then on.
    """

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
        """Write the counters if they changed since the last write (or ``force``).

        Returns:
            False once the counters are gone (their scheduler was collected).
        """
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
        """Stop the thread and write the final counters."""
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
