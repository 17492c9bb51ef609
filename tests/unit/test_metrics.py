"""The guard's series on the registry vLLM serves at ``/metrics``, one per engine.

The end-to-end proof (real ``api_server``, DP=1, DP=2, two API servers) is
``tests/e2e/test_metrics_endpoint.py``; these pin the pieces on the installed vLLM.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_prefix_guard import metrics, plugin
from vllm_prefix_guard.patching import is_guard_patch
from vllm_prefix_guard.stats import GuardStats
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import Driver


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("vllm:prefix_guard")
    }


def write_engine(directory: Path, engine: int, **counters: int) -> None:
    (directory / f"engine-{engine}.json").write_text(
        json.dumps({"model_name": "m", "engine": str(engine), "counters": counters})
    )


def test_each_counter_keeps_its_name_from_the_guard_to_metrics() -> None:
    """One name per counter: the series read ``GuardStats``' fields by name, the causes of
    ``rolled_back`` are exactly its ``rolled_back_*`` fields, and the total sums all of
    them (a cause added on one side only fails here, not silently on ``/metrics``)."""
    fields = {field.name for field in dataclasses.fields(GuardStats)}
    causes = sorted(f for f in fields if f.startswith("rolled_back_"))
    assert sorted(metrics.ROLLBACK_CAUSES.values()) == causes
    stats = GuardStats(**{cause: 10**i for i, cause in enumerate(causes)})
    assert stats.rolled_back == sum(10**i for i in range(len(causes)))
    series = {key for _, _, _, keys in metrics.FAMILIES for key in keys}
    # The peak is kept in the files only; the gauge is the guard's, not a GuardStats field.
    assert series == fields - {"peak_uncommitted_entries"} | {metrics.UNCOMMITTED}


def test_one_series_per_engine_with_vllm_labels(tmp_path: Path) -> None:
    write_engine(tmp_path, 0, registrations_tracked=7, rolled_back_preempted=2)
    write_engine(tmp_path, 1, registrations_tracked=5, rolled_back_kv_load_failure=3)
    (tmp_path / "engine-2.json").write_text("{not json")  # a torn file is skipped
    registry = CollectorRegistry()
    registry.register(metrics.GuardCollector(str(tmp_path)))
    samples = scrape(registry)
    engine0 = (("engine", "0"), ("model_name", "m"))
    assert samples[("vllm:prefix_guard_registrations_tracked_total", engine0)] == 7
    rollbacks = {
        (labels, value)
        for (name, labels), value in samples.items()
        if name == "vllm:prefix_guard_rolled_back_total" and value
    }
    assert rollbacks == {
        ((("cause", "preempted"), *engine0), 2),
        ((("cause", "kv_load_failure"), ("engine", "1"), ("model_name", "m")), 3),
    }
    assert samples[("vllm:prefix_guard_uncommitted_entries", engine0)] == 0


def test_one_api_server_serves_the_guard_from_the_default_registry(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """One API server: vLLM serves prometheus_client's REGISTRY, on which the plugin
    registers its collector when it loads (nothing of vLLM or prometheus_client patched)."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics import prometheus

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(metrics.RUN_DIR_ENV, str(run_dir))
    monkeypatch.delenv(metrics.MULTIPROC_DIR_ENV, raising=False)
    monkeypatch.setattr(metrics, "_registered", False)
    plugin.register()
    scheduler = make_scheduler(num_blocks=40)
    driver = Driver(scheduler)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=4))
    driver.run()
    scheduler.shutdown()  # the last write
    registry = prometheus.get_prometheus_registry()
    assert registry is REGISTRY
    try:
        samples = scrape(registry)
        tracked = [
            value
            for (name, _), value in samples.items()
            if name == "vllm:prefix_guard_registrations_tracked_total"
        ]
        assert tracked and tracked[0] > 0
        assert not any(is_guard_patch(p) for p in patched_prometheus())
    finally:
        for collector in list(REGISTRY._collector_to_names):
            if isinstance(collector, metrics.GuardCollector):
                REGISTRY.unregister(collector)


def patched_prometheus() -> list[object]:
    """What ``/metrics`` is built from, as the process sees it now."""
    from prometheus_client import multiprocess
    from vllm.v1.metrics import prometheus

    return [prometheus.get_prometheus_registry, multiprocess.MultiProcessCollector]


def export_engines(monkeypatch: pytest.MonkeyPatch, prom_dir: Path) -> None:
    """Two engines' counters in Prometheus' multiprocess files, as their publisher threads
    write them when several API servers serve /metrics (prometheus_client picks its
    multiprocess values when imported with the directory set, as an engine process is)."""
    from prometheus_client import values

    monkeypatch.setenv(metrics.MULTIPROC_DIR_ENV, str(prom_dir))
    monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue())
    for engine, counters in (
        (0, {"registrations_tracked": 5, "rolled_back_preempted": 1}),
        (1, {"registrations_tracked": 3, "uncommitted_entries": 2}),
    ):
        export = metrics.multiprocess_export({"model_name": "m", "engine": str(engine)})
        assert export is not None
        export.update({"registrations_tracked": 1})
        export.update(counters)  # counters advance by what changed


def test_several_api_servers_serve_the_guard_on_every_metrics_route(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With several API servers (Prometheus multiprocess mode) every scrape of ``/metrics``
    (prometheus-fastapi-instrumentator's endpoint) and ``/metrics/`` (vLLM's registry)
    builds a fresh registry around a ``MultiProcessCollector``: the engines' multiprocess
    files reach both, each series once per engine."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    export_engines(monkeypatch, prom_dir)
    app = FastAPI()
    attach_router(app)
    client = TestClient(app)
    expected = (
        'vllm:prefix_guard_registrations_tracked_total{engine="0",model_name="m"} 5.0',
        'vllm:prefix_guard_registrations_tracked_total{engine="1",model_name="m"} 3.0',
        'vllm:prefix_guard_rolled_back_total{cause="preempted",engine="0",model_name="m"} 1.0',
        'vllm:prefix_guard_uncommitted_entries{engine="1",model_name="m"} 2.0',
    )
    for route in ("/metrics", "/metrics/"):
        text = client.get(route).text
        for series in expected:
            assert text.count(series) == 1, (route, series, text[:400])


def test_a_server_started_from_a_guarded_process_makes_its_own_run_dir() -> None:
    """A process that loaded the guard exports its run directory; a server it starts
    (the e2e harness after an in-process engine test) must not inherit it, or two
    servers would serve each other's counters."""
    from guard_demo.server import server_env

    env = server_env("1", base={metrics.RUN_DIR_ENV: "/nonexistent", "PATH": "/usr/bin"})
    assert metrics.RUN_DIR_ENV not in env
    assert env["VLLM_PREFIX_GUARD"] == "1"
