"""The guard inside a real OpenAI-compatible server, switched only by ``VLLM_PREFIX_GUARD``.

Each server is ``python -m vllm.entrypoints.openai.api_server`` with its EngineCore in a separate
process, as in production: nothing in this test process applies the guard for it. vLLM's plugin
loader must find the ``prefix_guard`` entry point in every process and the guard must patch the
EngineCore's scheduler from the environment alone.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from server_pair import LaunchServer, Servers

from guard_demo.metrics import read_guard_rollbacks
from guard_demo.reference_check import check_against_reference
from guard_demo.server import GUARDED_NUM_GPU_BLOCKS, STARTUP_TIMEOUT_S, http_get_text
from guard_demo.workload import make_workload

pytestmark = pytest.mark.e2e

PATCH_LINE = re.compile(r"vllm-prefix-guard \S+: patched ")


def test_guard_patches_the_engine_core_process(servers: Servers) -> None:
    """The EngineCore process logs one patch line per hooked target."""
    engine_core_lines = [
        line
        for line in servers.guarded.log_text().splitlines()
        if PATCH_LINE.search(line) and "EngineCore" in line
    ]
    patched = " ".join(engine_core_lines)
    for target in ("Scheduler.schedule", "Scheduler._preempt_request", "update_from_output"):
        assert target in patched, engine_core_lines


def test_guarded_server_matches_reference(servers: Servers) -> None:
    """Concurrent, preempting, prefix-sharing traffic: every completion equals the reference;
    at shutdown the guard reports its counters, in its log and in its stats file."""
    items = [replace(item, cancel_after_s=None) for item in make_workload(32, seed=1)]
    check = check_against_reference(
        servers.guarded.url, servers.reference.url, items, concurrency=12, timeout_s=300
    )

    statuses = [o.status for o in check.outcomes + check.replayed]
    assert statuses == ["completed"] * (2 * len(items)), [o.error for o in check.failures]
    assert check.mismatches == {}
    # The workload did exercise what the guard is about.
    assert check.metrics.preemptions > 0 and check.metrics.prefix_cache_hits > 0, check.metrics

    servers.guarded.stop()
    logged = read_guard_rollbacks(None, servers.guarded.log_text())
    assert logged is not None
    # The file is also rewritten while the server runs; after shutdown it holds the final count.
    assert read_guard_rollbacks(servers.stats_file) == logged


def test_server_starts_normally_with_guard_unset(servers: Servers) -> None:
    assert http_get_text(f"{servers.reference.url}/health", timeout_s=10) == ""
    assert not PATCH_LINE.search(servers.reference.log_text())


def test_server_refuses_to_start_with_bad_guard_value(launch_server: LaunchServer) -> None:
    """A typo must not silently run unguarded: the server exits and names the variable."""
    server = launch_server(
        "bad-guard-value",
        guard="maybe",
        prefix_caching=True,
        num_gpu_blocks=GUARDED_NUM_GPU_BLOCKS,
    )
    returncode = server.wait_exit(timeout_s=STARTUP_TIMEOUT_S)
    assert returncode != 0
    log = server.log_text()
    assert "VLLM_PREFIX_GUARD" in log and "maybe" in log, server.log_tail()
