"""The guard's series on the registry vLLM serves at ``/metrics``, one per engine.

The end-to-end proof (real ``api_server``, DP=1, DP=2, two API servers) is
``tests/e2e/test_metrics_endpoint.py``; these pin the pieces on the installed vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from vllm_prefix_guard import metrics, plugin
from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.shadow_kv import Driver


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


@pytest.mark.parametrize("multiprocess", [False, True])
def test_the_registry_vllm_serves_carries_the_guard(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, multiprocess: bool
) -> None:
    """One API server (vLLM's default registry) and several (a multiprocess registry
    built per app): either way the registry vLLM mounts at /metrics has the guard."""
    from vllm.v1.metrics import prometheus

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(metrics.RUN_DIR_ENV, str(run_dir))
    if multiprocess:
        prom_dir = tmp_path / "prom"
        prom_dir.mkdir()
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom_dir))
    plugin.register()
    scheduler = make_scheduler(num_blocks=40)
    driver = Driver(scheduler)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=4))
    driver.run()
    scheduler.shutdown()  # the last write
    registry = prometheus.get_prometheus_registry()
    try:
        samples = scrape(registry)
        tracked = [
            value
            for (name, _), value in samples.items()
            if name == "vllm:prefix_guard_registrations_tracked_total"
        ]
        assert tracked and tracked[0] > 0
    finally:
        if not multiprocess:
            for collector in list(registry._collector_to_names):
                if isinstance(collector, metrics.GuardCollector):
                    registry.unregister(collector)


def test_several_api_servers_serve_the_guard_on_every_metrics_route(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """With several API servers (Prometheus multiprocess mode) vLLM's ``GET /metrics`` is
    answered by prometheus-fastapi-instrumentator's endpoint, which builds a fresh registry
    with a ``MultiProcessCollector`` for every scrape instead of using the registry vLLM
    passed it; only ``/metrics/`` reaches the registry from ``get_prometheus_registry``. Seen
    on a real ``vllm serve --api-server-count 2``: no guard series on ``/metrics`` at all."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_engine(run_dir, 0, registrations_tracked=7)
    prom_dir = tmp_path / "prom"
    prom_dir.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(prom_dir))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(metrics.RUN_DIR_ENV, str(run_dir))
    plugin.register()
    app = FastAPI()
    attach_router(app)
    client = TestClient(app)
    series = 'vllm:prefix_guard_registrations_tracked_total{engine="0",model_name="m"} 7.0'
    for route in ("/metrics", "/metrics/"):
        text = client.get(route).text
        assert text.count(series) == 1, (route, text[:300])


def test_a_server_started_from_a_guarded_process_makes_its_own_run_dir() -> None:
    """A process that loaded the guard exports its run directory; a server it starts
    (the e2e harness after an in-process engine test) must not inherit it, or two
    servers would serve each other's counters."""
    from guard_demo.server import server_env

    env = server_env("1", base={metrics.RUN_DIR_ENV: "/nonexistent", "PATH": "/usr/bin"})
    assert metrics.RUN_DIR_ENV not in env
    assert env["VLLM_PREFIX_GUARD"] == "1"
