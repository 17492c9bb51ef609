"""The counters' files: current without per-step I/O, one per engine, and never a danger.

Nothing that only reports may take the engine down: a bad path fails start-up with a
clear message (before any request), a write that fails later is logged once and serving
goes on, and vLLM's own ``shutdown`` runs even if reporting fails.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from vllm_prefix_guard import plugin
from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.hooks import PUBLISHER_ATTR, guard_of
from vllm_prefix_guard.log import LOGGER_NAME
from vllm_prefix_guard.metrics import RUN_DIR_ENV
from vllm_prefix_guard.stats import STATS_FILE_ENV, StatsPublisher, stats_file_path
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import Driver


def wait_for(predicate: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}


def test_the_last_counters_of_a_burst_reach_the_file_without_per_step_io(
    guard: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "guard.json"
    monkeypatch.setenv(STATS_FILE_ENV, str(path))
    scheduler = make_scheduler(num_blocks=40)
    scheduler_guard = guard_of(scheduler)
    assert scheduler_guard is not None
    writes: list[str] = []
    publisher = getattr(scheduler, PUBLISHER_ATTR)
    real_write = StatsPublisher.publish

    def counting_publish(self: StatsPublisher, force: bool = False) -> bool:
        writes.append("publish")
        return real_write(self, force)

    monkeypatch.setattr(StatsPublisher, "publish", counting_publish)
    driver = Driver(scheduler)
    for i in range(4):
        driver.add(make_request(f"r{i}", list(range(1 + 100 * i, 65 + 100 * i)), max_tokens=4))
    steps = driver.run()
    assert steps > 4 and len(writes) <= 2  # the thread, not the steps, writes
    wait_for(lambda: read(path).get("counters", {}).get("steps_committed") == steps)
    document = read(path)
    assert document["model_name"] and document["engine"] == "0"
    assert time.time() - document["updated_at"] < 10
    tracked = scheduler_guard.counters()["registrations_tracked"]
    assert tracked > 0 and document["counters"]["registrations_tracked"] == tracked
    assert publisher.paths == [str(path)]
    scheduler.shutdown()
    assert read(path)["counters"] == scheduler_guard.counters()


def test_a_stats_path_in_a_missing_directory_fails_start_up(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "missing" / "guard.json"))
    with pytest.raises(GuardConfigError, match=r"VLLM_PREFIX_GUARD_STATS_FILE=.*does not exist"):
        plugin.register()
    assert not plugin.is_applied()


def test_an_io_error_mid_run_is_logged_once_and_serving_goes_on(
    guard: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: Any
) -> None:
    directory = tmp_path / "stats"
    directory.mkdir()
    monkeypatch.setenv(STATS_FILE_ENV, str(directory / "guard.json"))
    scheduler = make_scheduler(num_blocks=40)
    publisher = getattr(scheduler, PUBLISHER_ATTR)
    driver = Driver(scheduler)
    driver.add(make_request("a", list(range(1, 65)), max_tokens=4))
    driver.step()
    wait_for(lambda: (directory / "guard.json").exists())
    for leftover in directory.iterdir():
        leftover.unlink()
    directory.rmdir()  # the volume went away
    logging.getLogger(LOGGER_NAME).propagate = True
    with caplog.at_level(logging.WARNING, logger=LOGGER_NAME):
        driver.add(make_request("b", list(range(200, 264)), max_tokens=4))
        driver.run()
        wait_for(lambda: not publisher.paths)
        driver.add(make_request("c", list(range(300, 364)), max_tokens=4))
        driver.run()
        scheduler.shutdown()
    warnings = [r for r in caplog.records if "cannot write the counters" in r.getMessage()]
    assert len(warnings) == 1 and driver.violations == 0
    assert scheduler.requests == {}


def test_vllm_shutdown_runs_even_if_reporting_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_prefix_guard import hooks

    real = Scheduler.__dict__["shutdown"]
    calls: list[Any] = []

    @functools.wraps(real)
    def spy(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "shutdown", spy)
    plugin.apply()
    try:
        scheduler = make_scheduler(num_blocks=40)
        monkeypatch.setattr(hooks, "report_counters", lambda *args: 1 / 0)
        scheduler.shutdown()  # no ZeroDivisionError escapes
        assert calls == [scheduler]
    finally:
        plugin.undo()  # before monkeypatch restores vLLM's method under the wrapper


@pytest.mark.parametrize(
    ("template", "engine", "engines", "expected"),
    [
        ("/s/guard.json", 0, 1, "/s/guard.json"),
        ("/s/guard.json", 0, 2, "/s/guard.engine0.json"),
        ("/s/guard.json", 1, 2, "/s/guard.engine1.json"),
        ("/s/guard-{engine}.json", 1, 2, "/s/guard-1.json"),
    ],
)
def test_each_engine_writes_its_own_file(
    template: str, engine: int, engines: int, expected: str
) -> None:
    assert stats_file_path(template, engine, engines) == expected


def test_the_run_directory_gets_one_file_per_engine(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(STATS_FILE_ENV, raising=False)
    plugin.register()
    scheduler = make_scheduler(num_blocks=40)
    scheduler.shutdown()
    assert read(tmp_path / "engine-0.json")["engine"] == "0"


def test_dense_data_parallel_engines_keep_their_rank_and_their_own_files(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """vLLM runs each data-parallel rank of a dense (non-MoE) model as an independent engine:
    before its scheduler exists, the EngineCore keeps the rank in ``data_parallel_index`` and
    rewrites ``data_parallel_rank`` to 0 and ``data_parallel_size`` to 1. Read from the rank,
    both engines of a DP=2 server labelled themselves ``engine="0"`` and wrote the same files
    (seen on a real ``--data-parallel-size 2`` server: one series on /metrics for two engines)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(RUN_DIR_ENV, str(run_dir))
    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "guard-{engine}.json"))
    plugin.register()

    def rank_of_two(rank: int) -> Callable[[Any], None]:
        def configure(config: Any) -> None:
            parallel = config.parallel_config
            parallel.data_parallel_size = 2
            parallel.data_parallel_index = rank  # what vLLM's run_engine_core does, then:
            parallel.reconfigure_for_independent_dp_rank()
            assert (parallel.data_parallel_rank, parallel.data_parallel_size) == (0, 1)

        return configure

    schedulers = [make_scheduler(num_blocks=40, configure=rank_of_two(r)) for r in (0, 1)]
    for scheduler in schedulers:
        scheduler.shutdown()
    assert sorted(p.name for p in run_dir.iterdir()) == ["engine-0.json", "engine-1.json"]
    for rank in (0, 1):
        assert read(run_dir / f"engine-{rank}.json")["engine"] == str(rank)
        assert read(tmp_path / f"guard-{rank}.json")["engine"] == str(rank)


def test_a_bad_stats_path_stops_start_up_with_one_line(tmp_path: Path) -> None:
    """What an operator sees: vLLM's plugin loader, as every vLLM process runs it at start,
    ends with the guard's one line (and no traceback through the loader)."""
    import os
    import subprocess
    import sys

    bad = tmp_path / "missing" / "guard.json"
    env = {**os.environ, plugin.ENV_VAR: "1", STATS_FILE_ENV: str(bad), "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_PLUGINS", None)
    done = subprocess.run(
        [sys.executable, "-c", "from vllm.plugins import load_general_plugins as l; l()"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("vllm-prefix-guard: VLLM_PREFIX_GUARD_STATS_FILE=")
    assert "does not exist" in last
