"""The counters the report needs: vLLM's and the guard's, from ``/metrics`` and the guard's files.

The guard's series (``vllm:prefix_guard_*``, one per engine, labels ``model_name`` and
``engine``) are served by vLLM's API server next to vLLM's own; after the server stopped, the
last word is the guard's stats files (``$VLLM_PREFIX_GUARD_STATS_FILE``, one per engine) or
its shutdown log line.
"""

from __future__ import annotations

import contextlib
import glob
import json
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard_demo.server import http_get_text

# The ``cause`` label of ``vllm:prefix_guard_rolled_back_total`` -> the counter key.
from vllm_prefix_guard.metrics import COUNTERS, ROLLBACK_CAUSES, ROLLED_BACK, UNCOMMITTED

__all__ = [
    "GUARD_PREFIX",
    "MetricsSnapshot",
    "MetricsTracer",
    "guard_counters_by_engine",
    "parse_samples",
    "per_engine",
    "read_guard_rollbacks",
    "read_guard_stats_files",
    "settled_scrape",
]

_COUNTERS_LINE = re.compile(r"vllm-prefix-guard counters:.*?\brolled_back=(\d+)")
#: Every series the guard exports starts with this.
GUARD_PREFIX = "vllm:prefix_guard_"
#: Sample name (``vllm:prefix_guard_`` left out) -> the counter key in the guard's files
#: (the same name; counters end in ``_total``).
GUARD_SAMPLES = {f"{key}_total": key for key, _ in COUNTERS} | {UNCOMMITTED: UNCOMMITTED}

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class MetricsSnapshot:
    """The three Prometheus counters the report needs, summed over label sets."""

    prefix_cache_queries: float
    prefix_cache_hits: float
    preemptions: float

    @classmethod
    def scrape(cls, server_url: str) -> MetricsSnapshot:
        return cls.parse(http_get_text(f"{server_url}/metrics"))

    @classmethod
    def parse(cls, text: str) -> MetricsSnapshot:
        return cls(
            prefix_cache_queries=_counter(text, "vllm:prefix_cache_queries"),
            prefix_cache_hits=_counter(text, "vllm:prefix_cache_hits"),
            preemptions=_counter(text, "vllm:num_preemptions"),
        )

    def __sub__(self, earlier: MetricsSnapshot) -> MetricsSnapshot:
        return MetricsSnapshot(
            prefix_cache_queries=self.prefix_cache_queries - earlier.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits - earlier.prefix_cache_hits,
            preemptions=self.preemptions - earlier.preemptions,
        )


def _counter(text: str, name: str) -> float:
    # prometheus_client exposes a counter as `<name>_total{labels} value`.
    pattern = re.compile(rf"^{re.escape(name)}_total(?:\{{[^}}]*\}})?\s+(\S+)$", re.MULTILINE)
    return sum(float(value) for value in pattern.findall(text))


def parse_samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """``(sample name, labels, value)`` of every sample of a Prometheus text exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, dict(sample.labels), float(sample.value)


def guard_counters_by_engine(text: str) -> dict[str, dict[str, float]]:
    """The guard's series of one scrape, by ``engine`` label, keyed like the guard's files
    (``registrations_tracked``, ``rolled_back_preempted``, ..., ``uncommitted_entries``)."""
    engines: dict[str, dict[str, float]] = {}
    for name, labels, value in parse_samples(text):
        if not name.startswith(GUARD_PREFIX):
            continue
        short = name[len(GUARD_PREFIX) :]
        counters = engines.setdefault(labels.get("engine", "?"), {})
        if short == f"{ROLLED_BACK}_total":
            counters[ROLLBACK_CAUSES.get(labels.get("cause", ""), short)] = value
        elif short in GUARD_SAMPLES:
            counters[GUARD_SAMPLES[short]] = value
    for counters in engines.values():
        counters["rolled_back"] = sum(counters.get(key, 0.0) for key in ROLLBACK_CAUSES.values())
    return dict(sorted(engines.items()))


#: vLLM's per-engine counters the demo reports next to the guard's.
VLLM_PER_ENGINE = {
    "vllm:prefix_cache_queries_total": "prefix_cache_queries",
    "vllm:prefix_cache_hits_total": "prefix_cache_hits",
    "vllm:num_preemptions_total": "preemptions",
}


def per_engine(text: str) -> dict[str, dict[str, float]]:
    """:func:`guard_counters_by_engine` plus vLLM's prefix-cache queries and hits and its
    preemptions, by ``engine`` label (engines without guard series included)."""
    engines = guard_counters_by_engine(text)
    for name, labels, value in parse_samples(text):
        if name in VLLM_PER_ENGINE:
            counters = engines.setdefault(labels.get("engine", "?"), {})
            key = VLLM_PER_ENGINE[name]
            counters[key] = counters.get(key, 0.0) + value
    return dict(sorted(engines.items()))


def settled_scrape(server_url: str, timeout_s: float = 15.0, interval_s: float = 1.5) -> str:
    """A ``/metrics`` scrape taken once the guard's series stopped changing.

    Engines publish their counters from a background thread about once a second; after a
    workload, two scrapes ``interval_s`` apart with equal guard series mean the last write is
    in. Returns the last scrape when ``timeout_s`` runs out.
    """
    deadline = time.monotonic() + timeout_s
    text = http_get_text(f"{server_url}/metrics")
    while time.monotonic() < deadline:
        time.sleep(interval_s)
        again = http_get_text(f"{server_url}/metrics")
        if guard_counters_by_engine(again) == guard_counters_by_engine(text):
            return again
        text = again
    return text


def read_guard_stats_files(template: str | Path) -> dict[str, dict[str, Any]]:
    """The guard's stats files of a server, by ``engine``: ``template`` is the value of
    ``VLLM_PREFIX_GUARD_STATS_FILE`` (``{engine}`` stands for any engine). Unreadable files
    are skipped."""
    pattern = glob.escape(str(template)).replace(glob.escape("{engine}"), "*")
    documents: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(pattern)):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            document = json.loads(Path(path).read_text())
            documents[str(document["engine"])] = document
    return documents


def read_guard_rollbacks(stats_file: str | Path | None, server_log: str = "") -> int | None:
    """Entries the guard rolled back in the server's EngineCores, or ``None`` if not reported.

    The guard lives in the EngineCore processes, out of this process's reach. Each keeps its
    counters as JSON in its ``$VLLM_PREFIX_GUARD_STATS_FILE`` (``{engine}`` in the name stands
    for its index), replaced atomically while it runs and once more at shutdown, and logs a
    ``vllm-prefix-guard counters: ... rolled_back=N ...`` line at shutdown. The files are
    preferred (summed over engines); the log lines cover servers started without them.

    Call this after the server has stopped, for the final count: while it runs, a file holds a
    snapshot up to a second old. If an EngineCore was killed before its shutdown, its file
    still holds its last snapshot.
    """
    if stats_file is not None:
        documents = read_guard_stats_files(stats_file)
        with contextlib.suppress(KeyError, TypeError, ValueError):
            if documents:
                return sum(int(d["counters"]["rolled_back"]) for d in documents.values())
    matches = _COUNTERS_LINE.findall(server_log)
    return sum(int(m) for m in matches) if matches else None


#: Families a metrics trace keeps: vLLM's prefix cache, preemptions and load, and the guard's.
_TRACED = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


class MetricsTracer:
    """Samples a server's ``/metrics`` every ``interval_s`` from a background thread.

    Each sample is ``{"t": seconds since start, "series": {"name{k=v,...}": value}}`` with
    vLLM's prefix-cache, preemption and load series and every guard series. A failed scrape is
    skipped. :meth:`to_json` is what ``python -m guard_demo --metrics-trace`` saves.
    """

    def __init__(self, server_url: str, interval_s: float = 1.0) -> None:
        self.server_url = server_url
        self.interval_s = interval_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metrics-tracer", daemon=True)
        self._start = 0.0

    def __enter__(self) -> MetricsTracer:
        self._start = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(self.interval_s):
                return

    def sample(self) -> None:
        t = round(time.monotonic() - self._start, 3)
        try:
            text = http_get_text(f"{self.server_url}/metrics", timeout_s=5.0)
        except OSError:
            return
        self.samples.append({"t": t, "series": dict(_traced_series(parse_samples(text)))})

    def to_json(self, **meta: Any) -> dict[str, Any]:
        return {**meta, "interval_s": self.interval_s, "samples": self.samples}


def _traced_series(
    samples: Iterable[tuple[str, dict[str, str], float]],
) -> Iterator[tuple[str, float]]:
    for name, labels, value in samples:
        if name in _TRACED or name.startswith(GUARD_PREFIX):
            keys = ",".join(f"{k}={v}" for k, v in sorted(labels.items()) if k != "model_name")
            yield f"{name}{{{keys}}}", value
