"""Failed KV-connector loads through the OpenAI-compatible server, guard on by environment.

An in-process engine stores eight prefixes with vLLM's ``ExampleConnector``. Then an
``api_server`` whose ``--kv-transfer-config`` names ``FailingExampleConnector``
(``kv_load_failure_policy="recompute"``; each prefix's first load fails for 1 to 5 blocks
drawn from the seed, garbage left in them) serves a concurrent workload sharing those
prefixes; ``VLLM_PREFIX_GUARD=1`` in its environment is all that enables the guard.
Every completion must equal a server with neither prefix caching nor connector, and the
guard's counters (stats file and ``/metrics``) must show the failed-load rollbacks.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Any

import pytest
from server_pair import Servers

from guard_demo.connector_scenarios import (
    failing_transfer_config,
    server_prefixes,
    server_workload,
    store_prompts,
)
from guard_demo.reference_check import check_against_reference
from guard_demo.server import http_get_text

pytestmark = pytest.mark.e2e

#: Enough blocks that nothing is preempted: the failed loads are the only hazard here
#: (``ExampleConnector`` cannot reload a request preempted after it decoded: it keys
#: the reload by prompt and output tokens, which it never stored).
NUM_GPU_BLOCKS = 160
_ROLLBACKS_LINE = re.compile(
    r'^vllm:prefix_guard_rolled_back_total\{[^}]*cause="kv_load_failure"[^}]*\}\s+(\S+)$',
    re.MULTILINE,
)


@pytest.fixture(scope="module")
def guarded_server_options(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """The prefixes stored (in-process, guard off) where the guarded server's failing
    connector loads them from."""
    storage = tmp_path_factory.mktemp("kv-store")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("VLLM_PREFIX_GUARD", raising=False)
        store_prompts(tiny_model, storage, [[*p, 1, 2] for p in server_prefixes()])
    assert len(os.listdir(storage)) == len(server_prefixes())
    transfer = failing_transfer_config(storage, "recompute", fail_blocks=0, fail_seed=1)
    return {
        "num_gpu_blocks": NUM_GPU_BLOCKS,
        "extra_args": ["--kv-transfer-config", json.dumps(transfer)],
    }


def test_guarded_server_with_failing_connector_matches_reference(servers: Servers) -> None:
    items = server_workload(server_prefixes(), seed=0)
    check = check_against_reference(
        servers.guarded.url, servers.reference.url, items, concurrency=12, timeout_s=300
    )
    assert not check.failures, [o.error for o in check.failures]
    assert len(check.completed) >= len(items) * 3 // 4, len(check.completed)
    assert check.mismatches == {}
    assert check.metrics.prefix_cache_hits > 0, check.metrics

    # The connector's failures reached the scheduler and the guard rolled them back.
    log = servers.guarded.log_text()
    assert "Recovered from KV load failure" in log, servers.guarded.log_tail()
    scraped = _metric_rollbacks(servers.guarded.url)
    assert scraped > 0

    servers.guarded.stop()
    counters = json.loads(servers.stats_file.read_text())["counters"]
    assert counters["rolled_back_kv_load_failure"] >= scraped, counters
    assert counters["uncommitted_entries"] == 0, counters


def _metric_rollbacks(url: str, timeout_s: float = 10.0) -> float:
    """The guard's failed-load rollbacks on ``/metrics`` (its files refresh every second)."""
    deadline = time.monotonic() + timeout_s
    value = 0.0
    while time.monotonic() < deadline:
        text = http_get_text(f"{url}/metrics")
        value = sum(float(v) for v in _ROLLBACKS_LINE.findall(text))
        if value > 0:
            break
        time.sleep(0.5)
    return value
