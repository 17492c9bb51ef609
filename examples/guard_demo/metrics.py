"""The counters the report needs: vLLM's from ``/metrics``, the guard's from its EngineCore."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

from guard_demo.server import http_get_text

__all__ = ["MetricsSnapshot", "read_guard_rollbacks"]

_COUNTERS_LINE = re.compile(r"vllm-prefix-guard counters:.*?\brolled_back=(\d+)")


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


def read_guard_rollbacks(stats_file: Path | None, server_log: str = "") -> int | None:
    """Entries the guard rolled back in the server's EngineCore, or ``None`` if not reported.

    The guard lives in the EngineCore process, out of this process's reach. It keeps its
    counters as JSON in ``$VLLM_PREFIX_GUARD_STATS_FILE``, replaced atomically every few seconds
    while it runs and once more at shutdown, and logs a ``vllm-prefix-guard counters: ...
    rolled_back=N ...`` line at shutdown. The file is preferred; the log line covers servers
    started without it.

    Call this after the server has stopped, for the final count: while it runs, the file holds a
    snapshot up to a few seconds old. If the EngineCore was killed before its shutdown, the file
    still holds its last snapshot.
    """
    if stats_file is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return int(json.loads(stats_file.read_text())["rolled_back"])
    matches = _COUNTERS_LINE.findall(server_log)
    return sum(int(m) for m in matches) if matches else None
