"""The guard's counters on vLLM's own ``/metrics``, one series per engine.

The counters live in each EngineCore (one per data-parallel rank); ``/metrics`` is served
by the API server process(es). vLLM has no channel between the two for a plugin (its
``SchedulerStats`` drops extra fields), so the guard uses the simplest one that cannot
disturb vLLM's own metrics:

- the first process that loads the plugin (the API server, or ``vllm serve``'s launcher
  with several API servers or data parallelism) makes a run directory and exports its
  path in :data:`RUN_DIR_ENV`, which every process it starts inherits;
- each EngineCore's :class:`~vllm_prefix_guard.stats.StatsPublisher` keeps
  ``engine-<rank>.json`` there current (a background thread; nothing on the step path);
- in the API server, :class:`GuardCollector` reads those files when ``/metrics`` is
  scraped. It is added to whichever registry vLLM serves (its own default registry, or
  the multiprocess one vLLM builds with several API servers) by wrapping vLLM's
  ``get_prometheus_registry``; vLLM's own metrics are untouched. With several API servers
  (Prometheus multiprocess mode), ``GET /metrics`` is answered by
  prometheus-fastapi-instrumentator's endpoint, which ignores that registry and builds a
  new one around a ``MultiProcessCollector`` for every scrape: the guard's collector joins
  every registry a ``MultiProcessCollector`` is built for, too.

Names follow vLLM's (``vllm:`` prefix, counters exported with ``_total``) and so do the
labels (``model_name``, ``engine``); past the prefix, each is the counter's own name. A
scrape never raises: an unreadable file is skipped.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger
from vllm_prefix_guard.patching import PatchRegistry

#: The run directory the engines and the API servers of one server share.
RUN_DIR_ENV = "VLLM_PREFIX_GUARD_RUN_DIR"
PROMETHEUS_MODULE = "vllm.v1.metrics.prometheus"
REGISTRY_FUNCTION = "get_prometheus_registry"
MULTIPROCESS_MODULE = "prometheus_client.multiprocess"
MULTIPROCESS_COLLECTOR = "MultiProcessCollector"

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
            PREFIX + ROLLED_BACK,
            "Prefix-cache registrations the guard removed before any request could hit them, "
            "by cause: the request was preempted in the same schedule() call, its KV load "
            "failed, or its step never came back.",
            labels=(*LABELS, "cause"),
        )
        uncommitted = GaugeMetricFamily(
            PREFIX + UNCOMMITTED,
            "Registrations of steps in flight, not yet committed.",
            labels=LABELS,
        )
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


_served: weakref.WeakSet[Any] = weakref.WeakSet()


def add_collector(registry: Any) -> None:
    """Add the guard's collector to ``registry`` once; never raise (reporting only)."""
    directory = run_dir()
    if directory is None or registry in _served:
        return
    try:
        registry.register(GuardCollector(directory))
        _served.add(registry)
    except Exception as exc:  # vLLM serves on without the guard's series
        logger().warning("vllm-prefix-guard: /metrics will not show the guard (%s)", exc)


def wrap_get_prometheus_registry(original: Callable[[], Any]) -> Callable[[], Any]:
    import functools

    @functools.wraps(original)
    def get_prometheus_registry(*args: Any, **kwargs: Any) -> Any:
        registry = original(*args, **kwargs)
        add_collector(registry)
        return registry

    return get_prometheus_registry


def wrap_multiprocess_collector(original: type) -> type:
    """``MultiProcessCollector`` whose registry also gets the guard's collector."""

    class MultiProcessCollector(original):
        def __init__(self, registry: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(registry, *args, **kwargs)
            if registry is not None:
                add_collector(registry)

    for attribute in ("__name__", "__qualname__", "__module__", "__doc__"):
        setattr(MultiProcessCollector, attribute, getattr(original, attribute))
    return MultiProcessCollector


def install(registry: PatchRegistry) -> list[str]:
    """Serve the guard's series on ``/metrics``: wrap vLLM's registry function where it is
    defined and in every module that already imported it by name.

    Returns:
        The patched targets' names (none if this vLLM has no such function: the counters
        then stay in the files and the shutdown line, and ``doctor`` says so).
    """
    module = sys.modules.get(PROMETHEUS_MODULE)
    if module is None:
        try:
            import importlib

            module = importlib.import_module(PROMETHEUS_MODULE)
        except ImportError:
            return []
    original = getattr(module, REGISTRY_FUNCTION, None)
    if not callable(original):
        return []
    patched = []
    # vars(), not getattr(): a lazy module's __getattr__ must not run (or import) here.
    holders = [module] + [
        m
        for name, m in list(sys.modules.items())
        if name.startswith("vllm.")
        and m is not module
        and vars(m).get(REGISTRY_FUNCTION) is original
    ]
    for holder in holders:
        registry.apply(holder, REGISTRY_FUNCTION, wrap_get_prometheus_registry)
        patched.append(f"{holder.__name__}.{REGISTRY_FUNCTION}")
    # Callers build it through the module (``multiprocess.MultiProcessCollector(...)``:
    # vLLM's get_prometheus_registry, the instrumentator's /metrics endpoint).
    multiprocess = sys.modules.get(MULTIPROCESS_MODULE)
    if multiprocess is None:
        try:
            import importlib

            multiprocess = importlib.import_module(MULTIPROCESS_MODULE)
        except ImportError:
            multiprocess = None
    if multiprocess is not None and isinstance(
        vars(multiprocess).get(MULTIPROCESS_COLLECTOR), type
    ):
        registry.apply(multiprocess, MULTIPROCESS_COLLECTOR, wrap_multiprocess_collector)
        patched.append(f"{MULTIPROCESS_MODULE}.{MULTIPROCESS_COLLECTOR}")
    return patched
