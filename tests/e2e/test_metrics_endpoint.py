"""The guard's counters on vLLM's own ``/metrics``, on real servers, as an operator sees them.

Three set-ups of the tiny model on CPU, the guard switched on by ``VLLM_PREFIX_GUARD=1`` alone:

* ``dp1``: ``python -m vllm.entrypoints.openai.api_server``, one EngineCore (vLLM's default
  registry);
* ``dp2``: the same with ``--data-parallel-size 2``: one API server, two EngineCores; this one
  also asks for the operator's stats files (``VLLM_PREFIX_GUARD_STATS_FILE`` with ``{engine}``);
* ``api2``: ``vllm serve --api-server-count 2``: two API servers on one port, one EngineCore,
  vLLM's Prometheus multiprocess registry.

Each set-up is one experiment, run once by a module-scoped fixture (so the servers are shared by
all assertions): a guarded server and a stock server of the same set-up (guard unset) start
side by side, both serve the same short concurrent workload with shared prefixes, every
completion of the guarded server is checked against a server without prefix caching (one for
the module), ``/metrics`` of both and the guard's files are read, and both servers are stopped.
The tests then check what was recorded:

* the guard's series appear once per engine, labelled ``model_name`` and ``engine`` = DP rank;
* their values equal each engine's file (read at the same moment) and, for ``dp2``, each
  engine's stats file after shutdown;
* vLLM's own metric set (every non-guard family's name and label names) is the same with the
  guard on and off;
* each EngineCore logs one patch line per patched target, and writes its own files only;
* every server stops cleanly: no traceback, no ``EngineDeadError``, no force-kill (vLLM's own
  shutdown race, vllm#48745, which strikes servers with and without the guard alike, is told
  apart: :func:`guard_demo.server.known_vllm_shutdown_race`).

The guarded servers get ``TMPDIR`` (a directory of the test) so that the run directory the guard
makes for its engines' files can be found and read; it is not a guard setting.
"""

from __future__ import annotations

import os
import re
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from guard_demo.metrics import (
    GUARD_PREFIX,
    guard_counters_by_engine,
    parse_samples,
    read_guard_stats_files,
    settled_scrape,
)
from guard_demo.reference_check import ReferenceCheck, check_against_reference
from guard_demo.server import (
    GUARDED_NUM_GPU_BLOCKS,
    REFERENCE_NUM_GPU_BLOCKS,
    SERVED_MODEL_NAME,
    STARTUP_TIMEOUT_S,
    ApiServer,
    free_port,
    http_get_text,
    known_vllm_shutdown_race,
    serve_args,
    server_env,
    shutdown_problems,
)
from guard_demo.workload import make_workload, run_workload
from vllm_prefix_guard.metrics import ROLLBACK_CAUSES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: Where the vLLM metric names of a real scrape are kept (``tests/harness/test_dashboard.py`` reads
#: them); ``PREFIX_GUARD_UPDATE_FIXTURES=1`` rewrites the file from this module's scrape (not a
#: ``VLLM_`` name: vLLM warns about every ``VLLM_`` variable it does not know).
METRIC_NAMES_DIR = Path(__file__).resolve().parents[1] / "data"
UPDATE_FIXTURES = os.environ.get("PREFIX_GUARD_UPDATE_FIXTURES") == "1"
#: Start-up of three servers at once, two of them with two EngineCores, on two shared cores.
STARTUP_S = max(STARTUP_TIMEOUT_S, 900.0)
PATCH_LINE = re.compile(
    r"^\((?P<process>EngineCore(?:_DP\d+)?) pid=(?P<pid>\d+)\).*"
    r"vllm-prefix-guard \S+: patched (?P<target>\S+) "
)
COUNTERS_LINE = re.compile(
    r"^\((?P<process>EngineCore(?:_DP\d+)?) pid=(?P<pid>\d+)\).*vllm-prefix-guard counters: (.*)$"
)


@dataclass(frozen=True)
class SetUp:
    name: str
    engines: int
    serve_kwargs: dict[str, Any] = field(default_factory=dict)
    #: Ask for the operator's stats files (``{engine}`` in the name).
    stats_files: bool = False


SETUPS = {
    s.name: s
    for s in (
        SetUp("dp1", 1),
        SetUp("dp2", 2, {"data_parallel_size": 2}, stats_files=True),
        SetUp("api2", 1, {"api_server_count": 2}),
    )
}


@dataclass
class Observed:
    """What one set-up's experiment recorded."""

    setup: SetUp
    check: ReferenceCheck
    #: Settled scrapes of the guarded server (several with two API servers behind the port).
    guarded_scrapes: list[str]
    stock_scrape: str
    #: The run directory's files, read right after the first settled scrape, by engine.
    run_dir_files: dict[str, dict[str, Any]]
    run_dir: Path
    #: The operator's stats files after shutdown, by engine (``stats_files`` set-ups only).
    stats_files: dict[str, dict[str, Any]]
    guarded: ApiServer
    stock: ApiServer
    seconds: dict[str, float]


def _server(
    name: str, tmp: Path, model: Path, guard: str | None, stats_file: Path | None, **kwargs: Any
) -> ApiServer:
    port = free_port()
    env = server_env(guard, stats_file=stats_file)
    env["TMPDIR"] = str(tmp / f"{name}-tmp")
    Path(env["TMPDIR"]).mkdir(parents=True)
    return ApiServer(serve_args(model, port, **kwargs), env, tmp / f"{name}.log", port)


@pytest.fixture(scope="module")
def reference(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiServer]:
    """A server without prefix caching, for every set-up's reference check; started here, not
    waited for (the first set-up's servers start meanwhile)."""
    tmp = tmp_path_factory.mktemp("reference")
    server = _server(
        "reference",
        tmp,
        tiny_model,
        None,
        None,
        prefix_caching=False,
        num_gpu_blocks=REFERENCE_NUM_GPU_BLOCKS,
    )
    with server:
        yield server


@pytest.fixture(scope="module", params=list(SETUPS))
def observed(
    request: pytest.FixtureRequest,
    reference: ApiServer,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Observed]:
    setup = SETUPS[request.param]
    tmp = tmp_path_factory.mktemp(setup.name)
    stats_template = tmp / "stats.{engine}.json" if setup.stats_files else None
    kwargs = dict(prefix_caching=True, num_gpu_blocks=GUARDED_NUM_GPU_BLOCKS, **setup.serve_kwargs)
    guarded = _server("guarded", tmp, tiny_model, "1", stats_template, **kwargs)
    stock = _server("stock", tmp, tiny_model, None, None, **kwargs)
    seconds: dict[str, float] = {}
    started = time.monotonic()
    with guarded, stock:
        for server in (reference, guarded, stock):
            server.wait_healthy(STARTUP_S)
        seconds["start"] = time.monotonic() - started
        # Shared prefixes, preemption pressure; no client cancels, so every request completes.
        items = [replace(item, cancel_after_s=None) for item in make_workload(16, seed=7)]
        mark = time.monotonic()
        check = check_against_reference(
            guarded.url, reference.url, items, concurrency=12, timeout_s=300
        )
        run_workload(stock.url, items, concurrency=12, timeout_s=300)
        seconds["workloads"] = time.monotonic() - mark
        guarded_scrapes = [settled_scrape(guarded.url)]
        run_dirs = list(Path(guarded.env["TMPDIR"]).glob("vllm-prefix-guard-*"))
        assert len(run_dirs) == 1, run_dirs
        run_dir_files = read_guard_stats_files(run_dirs[0] / "engine-{engine}.json")
        # Two API servers share the port: scrape a few times to meet both.
        guarded_scrapes += [
            http_get_text(f"{guarded.url}/metrics")
            for _ in range(5 if "api_server_count" in setup.serve_kwargs else 0)
        ]
        stock_scrape = http_get_text(f"{stock.url}/metrics")
        mark = time.monotonic()
        stock.terminate()
        guarded.stop()
        stock.stop()
        seconds["stop"] = time.monotonic() - mark
    stats_files = read_guard_stats_files(stats_template) if stats_template else {}
    seconds["total"] = time.monotonic() - started
    print(f"\n{setup.name}: " + ", ".join(f"{k} {v:.0f}s" for k, v in seconds.items()))
    yield Observed(
        setup,
        check,
        guarded_scrapes,
        stock_scrape,
        run_dir_files,
        run_dirs[0],
        stats_files,
        guarded,
        stock,
        seconds,
    )


def _engines(setup: SetUp) -> list[str]:
    return [str(engine) for engine in range(setup.engines)]


#: The counters /metrics and the guard's files both carry, as guard_counters_by_engine keys them.
KEYS = (
    "registrations_tracked",
    "steps_committed",
    "stale_entries_skipped",
    "dependents_preempted",
    "uncommitted_entries",
    "rolled_back_preempted",
    "rolled_back_kv_load_failure",
    "rolled_back_dropped_step",
    "rolled_back",
)


def _from_file(document: dict[str, Any]) -> dict[str, float]:
    return {key: float(document["counters"][key]) for key in KEYS}


def _from_scrape(text: str) -> dict[str, dict[str, float]]:
    return {e: {k: c[k] for k in KEYS} for e, c in guard_counters_by_engine(text).items()}


def _families(text: str, guard: bool) -> dict[str, frozenset[str]]:
    """Sample name -> label names, of the guard's samples or of everything else."""
    families: dict[str, set[str]] = {}
    for name, labels, _ in parse_samples(text):
        if name.startswith(GUARD_PREFIX) == guard:
            families.setdefault(name, set()).update(labels)
    return {name: frozenset(labels) for name, labels in families.items()}


def test_every_completion_matches_the_reference(observed: Observed) -> None:
    check = observed.check
    statuses = [o.status for o in check.outcomes + check.replayed]
    assert statuses == ["completed"] * len(statuses), [o.error for o in check.failures]
    assert check.mismatches == {}
    assert check.metrics.prefix_cache_hits > 0, check.metrics  # prefixes were shared


def test_guard_series_once_per_engine_with_vllm_labels(observed: Observed) -> None:
    engines = _engines(observed.setup)
    for text in observed.guarded_scrapes:
        samples = [
            (n, labels) for n, labels, _ in parse_samples(text) if n.startswith(GUARD_PREFIX)
        ]
        keys = Counter((n, tuple(sorted(labels.items()))) for n, labels in samples)
        assert max(keys.values()) == 1, [k for k, c in keys.items() if c > 1]
        by_name: dict[str, list[str]] = {}
        for name, labels in samples:
            expected = {"model_name", "engine"} | ({"cause"} if "rolled_back" in name else set())
            assert set(labels) == expected, (name, labels)
            assert labels["model_name"] == SERVED_MODEL_NAME
            by_name.setdefault(name, []).append(labels["engine"])
        assert set(by_name) == {
            "vllm:prefix_guard_registrations_tracked_total",
            "vllm:prefix_guard_steps_committed_total",
            "vllm:prefix_guard_stale_entries_skipped_total",
            "vllm:prefix_guard_dependents_preempted_total",
            "vllm:prefix_guard_rolled_back_total",
            "vllm:prefix_guard_uncommitted_entries",
        }
        for name, seen in by_name.items():
            # One series per rollback cause.
            rolled_back = name == "vllm:prefix_guard_rolled_back_total"
            per_engine = len(ROLLBACK_CAUSES) if rolled_back else 1
            assert sorted(seen) == sorted(engines * per_engine), (name, seen)
    # Every engine served requests and tracked registrations.
    by_engine = guard_counters_by_engine(observed.guarded_scrapes[0])
    assert all(by_engine[e]["registrations_tracked"] > 0 for e in engines), by_engine
    # Every API server behind the port serves the same values.
    assert all(guard_counters_by_engine(text) == by_engine for text in observed.guarded_scrapes)


def test_guard_series_equal_the_engines_files(observed: Observed) -> None:
    scraped = _from_scrape(observed.guarded_scrapes[0])
    files = {engine: _from_file(d) for engine, d in observed.run_dir_files.items()}
    assert files == scraped
    assert all(counters["uncommitted_entries"] == 0 for counters in files.values())
    # The run directory goes with the server.
    assert not observed.run_dir.exists()


def test_stats_files_after_shutdown_equal_what_metrics_served(observed: Observed) -> None:
    if not observed.setup.stats_files:
        pytest.skip("this set-up does not ask for stats files")
    assert sorted(observed.stats_files) == _engines(observed.setup)
    assert all(d["model_name"] == SERVED_MODEL_NAME for d in observed.stats_files.values())
    stats = {engine: _from_file(d) for engine, d in observed.stats_files.items()}
    assert stats == _from_scrape(observed.guarded_scrapes[0])


def test_vllm_metric_set_is_the_same_with_the_guard_on_and_off(observed: Observed) -> None:
    guarded = _families(observed.guarded_scrapes[0], guard=False)
    stock = _families(observed.stock_scrape, guard=False)
    assert guarded == stock, {
        "only with the guard": sorted(set(guarded.items()) - set(stock.items())),
        "only without": sorted(set(stock.items()) - set(guarded.items())),
    }
    assert not _families(observed.stock_scrape, guard=True)  # stock has no guard series
    names_file = METRIC_NAMES_DIR / "vllm-metric-names.txt"
    # `_created` samples are left out: vLLM's multiprocess registry (two API servers) has none.
    names = sorted(
        n
        for n in _families(observed.stock_scrape, guard=False)
        if n.startswith("vllm:") and not n.endswith("_created")
    )
    if UPDATE_FIXTURES and observed.setup.name == "dp1":
        names_file.write_text("\n".join(names) + "\n")
    # The dashboard test relies on these names; every set-up exports each of them.
    assert set(names_file.read_text().split()) <= set(names)


def test_each_engine_core_logs_one_patch_line_per_target_and_writes_its_own_files(
    observed: Observed,
) -> None:
    from vllm_prefix_guard.patches import PATCHES

    log = observed.guarded.log_text().splitlines()
    patched: dict[str, list[str]] = {}
    process_of: dict[str, str] = {}
    for line in log:
        if match := PATCH_LINE.match(line):
            patched.setdefault(match["pid"], []).append(match["target"])
            process_of[match["pid"]] = match["process"]
    assert len(patched) == observed.setup.engines, process_of
    expected = {p.path for p in PATCHES if p.name is not None}
    for pid, targets in patched.items():
        assert len(targets) == len(set(targets)), (pid, targets)  # one line per target
        assert expected <= set(targets), (pid, sorted(expected - set(targets)))
        assert set(targets) == set(next(iter(patched.values())))  # the same in every engine
    # Each engine's files were written by its own EngineCore, and by no other.
    engine_pids = set(patched)
    file_pids = [str(d["pid"]) for d in observed.run_dir_files.values()]
    assert sorted(file_pids) == sorted(engine_pids)
    for documents in (observed.run_dir_files, observed.stats_files):
        assert len({d["pid"] for d in documents.values()}) == len(documents)
        for engine, document in documents.items():
            assert document["engine"] == engine
    if observed.setup.engines > 1:
        ranks = {process_of[str(d["pid"])]: e for e, d in observed.run_dir_files.items()}
        assert ranks == {f"EngineCore_DP{e}": e for e in _engines(observed.setup)}
    # One counters line per EngineCore at shutdown.
    counters_pids = [m["pid"] for line in log if (m := COUNTERS_LINE.match(line))]
    assert sorted(counters_pids) == sorted(engine_pids)


def test_servers_stop_cleanly(observed: Observed) -> None:
    """No force-kill, no traceback; vLLM's own shutdown race (vllm#48745: an EngineDeadError
    traceback from the API server's output handler after an orderly engine shutdown, guard or
    not) is told apart and only reported."""
    for server in (observed.guarded, observed.stock):
        assert server.force_killed == [], server.log_path
        assert shutdown_problems(server.log_text()) == [], server.log_path
        if race := known_vllm_shutdown_race(server.log_text()):
            print(f"\n{server.log_path}: vLLM's shutdown race (vllm#48745), {len(race)} lines")
