"""The guard's counters on vLLM's own ``/metrics``, one series per engine, through
prometheus_client's own channels: nothing of vLLM or prometheus_client is patched.

The counters live in each EngineCore (one per data-parallel rank); ``/metrics`` is served
by the API server process(es). vLLM's ``vllm.v1.metrics.prometheus.get_prometheus_registry``
decides which channel reaches it:

- one API server: it serves prometheus_client's global ``REGISTRY``. The first process
  that loads the plugin makes a run directory (:data:`RUN_DIR_ENV`, inherited by the
  processes it starts); each engine's :class:`~vllm_prefix_guard.stats.StatsPublisher`
  keeps ``engine-<rank>.json`` there current (a background thread, nothing on the step
  path), and :class:`GuardCollector`, registered on ``REGISTRY`` when the plugin loads,
  reads those files when ``/metrics`` is scraped;
- several API servers (``PROMETHEUS_MULTIPROC_DIR`` set by vLLM's launcher, inherited by
  the engines): every scrape builds a fresh registry around a ``MultiProcessCollector``,
  which reads prometheus_client's multiprocess files. The publisher thread of each engine
  writes its counters there itself (:class:`MultiprocessExport`).

Names follow vLLM's (``vllm:`` prefix, counters exported with ``_total``) and so do the
labels (``model_name``, ``engine``); past the prefix, each is the counter's own name. A
scrape never raises: an unreadable file is skipped.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger

#: The run directory the engines and the API servers of one server share.
RUN_DIR_ENV = "VLLM_PREFIX_GUARD_RUN_DIR"
#: Set by vLLM's launcher when several API servers serve ``/metrics`` (Prometheus'
#: multiprocess mode), and inherited by the engines.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"

#: Every series is ``vllm:prefix_guard_<key>``, ``<key>`` the counter's name in
#: :class:`~vllm_prefix_guard.stats.GuardStats` and the engines' files: one name per
#: counter from the pool to ``/metrics``. (key, help) of the plain counters:
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
ROLLBACK_HELP = (
    "Prefix-cache registrations the guard removed before any request could hit them, by "
    "cause: the request was preempted in the same schedule() call, its KV load failed, or "
    "its step never came back."
)
UNCOMMITTED_HELP = "Registrations of steps in flight, not yet committed."

LABELS = ("model_name", "engine")


def run_dir() -> str | None:
    return os.environ.get(RUN_DIR_ENV) or None


def check_run_dir_setting() -> str:
    """Where this process finds its server's run directory (inherited in
    :data:`RUN_DIR_ENV`) or will make it (the temporary directory); the server's processes
    must be able to write there.

    Raises:
        GuardConfigError: the inherited directory is gone or not writable, or there is no
            writable temporary directory to make one in (checked at start-up, so the guard's
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

        documents = list(self._documents())
        for key, help_text in COUNTERS:
            family = CounterMetricFamily(PREFIX + key, help_text, labels=LABELS)
            for labels, counters in documents:
                family.add_metric(labels, counters.get(key, 0))
            yield family
        rollbacks = CounterMetricFamily(
            PREFIX + ROLLED_BACK, ROLLBACK_HELP, labels=(*LABELS, "cause")
        )
        uncommitted = GaugeMetricFamily(PREFIX + UNCOMMITTED, UNCOMMITTED_HELP, labels=LABELS)
        for labels, counters in documents:
            for cause, key in ROLLBACK_CAUSES.items():
                rollbacks.add_metric([*labels, cause], counters.get(key, 0))
            uncommitted.add_metric(labels, counters.get(UNCOMMITTED, 0))
        yield rollbacks
        yield uncommitted

    def _documents(self) -> Iterator[tuple[list[str], dict[str, int]]]:
        try:
            paths = sorted(self.directory.glob("engine-*.json"))
        except OSError:
            return
        for path in paths:
            try:
                document = json.loads(path.read_text())
                labels = [str(document["model_name"]), str(document["engine"])]
                counters = {k: int(v) for k, v in document["counters"].items()}
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue
            yield labels, counters


_registered = False


def install() -> None:
    """Serve the guard's series on ``/metrics`` with one API server: register
    :class:`GuardCollector` on prometheus_client's ``REGISTRY``, the registry vLLM serves
    then (several API servers: :class:`MultiprocessExport`). Once per process; never
    raises (reporting only): a failure is logged and vLLM serves on without the series.
    """
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
    """One engine's counters in Prometheus' multiprocess files (several API servers): the
    ``MultiProcessCollector`` vLLM builds for every scrape reads them. Counters are advanced
    by what changed since the last call; called by the publisher thread only."""

    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Gauge

        self._labels = [labels[name] for name in LABELS]
        self._counters = {
            key: Counter(PREFIX + key, text, LABELS, registry=None).labels(*self._labels)
            for key, text in COUNTERS
        }
        rolled_back = Counter(
            PREFIX + ROLLED_BACK, ROLLBACK_HELP, (*LABELS, "cause"), registry=None
        )
        for cause, key in ROLLBACK_CAUSES.items():
            self._counters[key] = rolled_back.labels(*self._labels, cause)
        gauge = Gauge(
            PREFIX + UNCOMMITTED,
            UNCOMMITTED_HELP,
            LABELS,
            registry=None,
            multiprocess_mode="mostrecent",
        )
        self._uncommitted = gauge.labels(*self._labels)
        self._last: dict[str, int] = {}

    def update(self, counters: dict[str, int]) -> None:
        for key, counter in self._counters.items():
            delta = counters.get(key, 0) - self._last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
        self._uncommitted.set(counters.get(UNCOMMITTED, 0))
        self._last = dict(counters)


def multiprocess_export(labels: dict[str, str]) -> MultiprocessExport | None:
    """The engine's multiprocess export when several API servers serve ``/metrics``
    (prometheus_client writes its values to files only then); None otherwise."""
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
