"""The guard's counters on vLLM's own ``/metrics``, one series per engine, through
prometheus_client's own channels, as vLLM's ``get_prometheus_registry`` picks them (nothing
patched; docs/operations.md): with one API server, :class:`GuardCollector` on ``REGISTRY``
reads the ``engine-<rank>.json`` each engine's publisher thread keeps in the run directory;
with several (``PROMETHEUS_MULTIPROC_DIR``), each engine writes prometheus_client's
multiprocess files (:class:`MultiprocessExport`). A scrape never raises.
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger

#: The run directory the engines and the API servers of one server share.
RUN_DIR_ENV = "VLLM_PREFIX_GUARD_RUN_DIR"
#: Set by vLLM's launcher for several API servers, and inherited by the engines.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Every series is ``vllm:prefix_guard_<key>``, ``<key>`` the counter's name in
#: :class:`~vllm_prefix_guard.stats.GuardStats` and the engines' files. The plain counters:
COUNTERS: tuple[tuple[str, str], ...] = (
    (
        "registrations_tracked",
        "Prefix-cache registrations made for tokens a step is about to compute, tracked "
        "by the guard until the step's output commits them.",
    ),
    ("steps_committed", "Scheduler steps whose registrations were committed."),
    (
        "stale_entries_skipped",
        "Rollback records skipped because their block had been evicted or re-registered.",
    ),
    (
        "dependents_preempted",
        "Requests made to recompute (preempted, or their output in flight dropped) "
        "because they computed over rolled-back blocks.",
    ),
)
PREFIX = "vllm:prefix_guard_"
#: ``rolled_back_<cause>`` in the files, ``vllm:prefix_guard_rolled_back{cause=...}`` here.
ROLLED_BACK = "rolled_back"
ROLLBACK_CAUSES = {
    cause: f"{ROLLED_BACK}_{cause}" for cause in ("preempted", "kv_load_failure", "dropped_step")
}
UNCOMMITTED = "uncommitted_entries"
LABELS = ("model_name", "engine")
ROLLBACK_HELP = (
    "Prefix-cache registrations the guard removed before any request could hit them, by "
    "cause: the request was preempted in the same schedule() call, its KV load failed, or "
    "its step never came back."
)
UNCOMMITTED_HELP = "Registrations of steps in flight, not yet committed."
#: Both channels' series: (name past the prefix, help, label names, {file key: label values
#: past LABELS}); each a counter but ``UNCOMMITTED``, a gauge.
FAMILIES: tuple[tuple[str, str, tuple[str, ...], Mapping[str, tuple[str, ...]]], ...] = (
    *((key, text, LABELS, {key: ()}) for key, text in COUNTERS),
    (ROLLED_BACK, ROLLBACK_HELP, (*LABELS, "cause"), {k: (c,) for c, k in ROLLBACK_CAUSES.items()}),
    (UNCOMMITTED, UNCOMMITTED_HELP, LABELS, {UNCOMMITTED: ()}),
)


def run_dir() -> str | None:
    return os.environ.get(RUN_DIR_ENV) or None


def check_run_dir_setting() -> str:
    """The inherited run directory, or the temporary directory to make one in.

    Raises:
        GuardConfigError: that directory is missing or not writable (at start-up, so the
            counters never silently miss ``/metrics``).
    """
    existing = run_dir()
    if existing is not None:
        if not os.path.isdir(existing) or not os.access(existing, os.W_OK):
            raise GuardConfigError(
                f"{RUN_DIR_ENV}={existing!r} is not a writable directory. The guard sets it "
                "for the processes of one server; unset it."
            )
        return existing
    try:
        parent = tempfile.gettempdir()
    except FileNotFoundError as exc:  # no usable temporary directory at all
        raise GuardConfigError(f"the guard's run directory cannot be made: {exc}") from exc
    if not os.access(parent, os.W_OK):
        raise GuardConfigError(
            f"the guard makes its run directory in {parent!r} (the temporary directory; "
            "TMPDIR), which is not writable."
        )
    return parent


def ensure_run_dir() -> str:
    """The run directory of this server, made (and exported) by the first process."""
    existing = run_dir()
    if existing is not None:
        return existing
    made = tempfile.mkdtemp(prefix="vllm-prefix-guard-")
    os.environ[RUN_DIR_ENV] = made
    creator = os.getpid()

    def remove() -> None:  # only by the process that made it, never by a forked child
        if os.getpid() == creator:
            shutil.rmtree(made, ignore_errors=True)

    atexit.register(remove)
    return made


def engine_file(directory: str, engine: int) -> str:
    return os.path.join(directory, f"engine-{engine}.json")


class GuardCollector:
    """A Prometheus collector over the engines' files in the run directory."""

    def __init__(self, directory: str) -> None:
        self.directory = Path(directory)

    def describe(self) -> list[Any]:
        return []  # no fixed description: registration never scrapes

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        documents = []
        for name in sorted(glob.glob("engine-*.json", root_dir=self.directory)):
            try:
                document = json.loads((self.directory / name).read_text())
                labels = [str(document["model_name"]), str(document["engine"])]
                counters = {k: int(v) for k, v in document["counters"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            documents.append((labels, counters))
        for family_name, text, names, keys in FAMILIES:
            kind = GaugeMetricFamily if family_name == UNCOMMITTED else CounterMetricFamily
            family = kind(PREFIX + family_name, text, labels=names)
            for labels, counters in documents:
                for key, values in keys.items():
                    family.add_metric([*labels, *values], counters.get(key, 0))
            yield family


_registered = False


def install() -> None:
    """Register :class:`GuardCollector` on ``REGISTRY`` (what one API server serves), once
    per process. Never raises (reporting only): vLLM serves on without the series."""
    global _registered
    directory = run_dir()
    if _registered or directory is None:
        return
    try:
        from prometheus_client import REGISTRY

        REGISTRY.register(GuardCollector(directory))
    except Exception as exc:  # vLLM serves on without the guard's series
        logger().warning("vllm-prefix-guard: /metrics will not show the guard (%s)", exc)
        return
    _registered = True


class MultiprocessExport:
    """One engine's counters in Prometheus' multiprocess files, advanced by what changed
    since the last :meth:`update`; called by the publisher thread only."""

    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        own = [labels[name] for name in LABELS]
        self._series: dict[str, Any] = {}
        for name, text, names, keys in FAMILIES:
            metric = (
                Gauge(PREFIX + name, text, names, registry=None, multiprocess_mode="mostrecent")
                if name == UNCOMMITTED
                else Counter(PREFIX + name, text, names, registry=None)
            )
            for key, values in keys.items():
                self._series[key] = metric.labels(*own, *values)
        self._last: dict[str, int] = {}

    def update(self, counters: dict[str, int]) -> None:
        for key, series in self._series.items():
            value = counters.get(key, 0)
            if key == UNCOMMITTED:
                series.set(value)
            elif value > (last := self._last.get(key, 0)):
                series.inc(value - last)
        self._last = dict(counters)


def multiprocess_export(labels: dict[str, str]) -> MultiprocessExport | None:
    """The engine's export when several API servers serve ``/metrics``; None otherwise."""
    if not os.environ.get(MULTIPROC_DIR_ENV):
        return None
    from prometheus_client import values

    if "MultiProcessValue" not in getattr(values.ValueClass, "__qualname__", ""):
        return None  # prometheus_client was imported before the directory was set
    try:
        return MultiprocessExport(labels)
    except Exception as exc:  # reporting only
        logger().warning("vllm-prefix-guard: /metrics will not show the guard (%s)", exc)
        return None
