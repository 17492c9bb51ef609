"""NVIDIA Dynamo's own KV-router code, fed an engine's published KV events, on CPU.

Two consumers of one vLLM ZMQ event stream (``--kv-events-config`` with the ``zmq``
publisher), as Dynamo deploys them (``ai-dynamo-runtime``; the project's notes,
``kv-event-consumers.md``):

- the *router*: a ``KvEventPublisher`` subscribed to the engine's socket, whose
  ``EventDedupFilter`` counts ``BlockStored`` per block hash and lets a ``BlockRemoved``
  through only when the count falls to 0, relaying to a ``KvRouter`` over Dynamo's event
  plane (one process: discovery in memory, the event plane on ZMQ, no NATS or etcd);
- the *indexer*: ``python -m dynamo.indexer`` (a set per worker, no filter), a subprocess
  subscribed to the same socket, queried over HTTP.

:meth:`DynamoRouters.credited` asks both how many leading blocks of a prompt they credit
the engine with. Events reach them asynchronously: :meth:`DynamoRouters.sync` first sends
a sentinel block through the engine's own publisher, after everything else, and waits
until both credit it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

BLOCK_SIZE = 16
MODEL = "guarded"


def sentinel_tokens(number: int, block_size: int, base: int = 500, span: int = 10) -> list[int]:
    """The ``number``-th sentinel block: ids from ``base`` to ``base + span - 1`` (above every
    prompt id the tests use, within the tiny model's vocabulary), its first six the digits
    of ``number`` in base ``span``, so that no two sentinels share a block."""
    digits = [base + number // span**k % span for k in range(6)]
    return digits + [base + span - 1] * (block_size - len(digits))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class DynamoRouters:
    """Dynamo's router (with its dedup filter) and its standalone indexer on one stream."""

    def __init__(
        self,
        zmq_endpoint: str,
        publish_sentinel: Callable[[list[int]], None],
        block_size: int = BLOCK_SIZE,
    ) -> None:
        self.block_size = block_size
        self.zmq_endpoint = zmq_endpoint
        self.publish_sentinel = publish_sentinel
        self.sentinels = 0
        for name in ("DYN_TCP_RPC_HOST", "DYN_HTTP_RPC_HOST", "DYN_SYSTEM_HOST", "DYN_ZMQ_HOST"):
            os.environ.setdefault(name, "127.0.0.1")
        os.environ.setdefault("DYN_LOG", "error")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.router, self.runtime = self._call(self._start_router())
        self.indexer_port = free_port()
        self.indexer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dynamo.indexer",
                "--port",
                str(self.indexer_port),
                "--block-size",
                str(block_size),
                "--model-name",
                MODEL,
                "--workers",
                f"1={zmq_endpoint}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._wait_for_indexer()

    def _call(self, coroutine: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    async def _start_router(self) -> tuple[Any, Any]:
        from dynamo.llm import (
            KvEventPublisher,
            KvRouter,
            KvRouterConfig,
            ModelInput,
            ModelType,
            WorkerType,
            register_model,
        )
        from dynamo.runtime import DistributedRuntime

        runtime = DistributedRuntime(asyncio.get_running_loop(), "mem", "tcp", event_plane="zmq")
        endpoint = runtime.endpoint("guard.worker.generate")

        async def generate(request: Any, context: Any = None) -> Any:
            yield {"token_ids": []}

        self.served = asyncio.ensure_future(endpoint.serve_endpoint(generate))
        await asyncio.sleep(0.5)
        await register_model(
            ModelInput.Tokens,
            ModelType.Completions,
            endpoint,
            MODEL,
            MODEL,
            worker_type=WorkerType.Aggregated,
            kv_cache_block_size=self.block_size,
            skip_model_assets=True,
        )
        self.publisher = KvEventPublisher(
            endpoint, kv_block_size=self.block_size, zmq_endpoint=self.zmq_endpoint
        )
        router = KvRouter(endpoint, self.block_size, KvRouterConfig())
        await asyncio.sleep(1.0)
        return router, runtime

    def _wait_for_indexer(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._indexer_query([1] * self.block_size)
                return
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("dynamo.indexer did not answer")

    def _indexer_query(self, token_ids: list[int]) -> int:
        body = json.dumps({"token_ids": token_ids, "model_name": MODEL}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.indexer_port}/query",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=10) as answer:
            scores = json.loads(answer.read()).get("scores", {})
        # The indexer scores a worker by the tokens of its matched blocks.
        tokens = max((int(n) for ranks in scores.values() for n in ranks.values()), default=0)
        return tokens // self.block_size

    def _router_query(self, token_ids: list[int]) -> int:
        async def query() -> Any:
            return await self.router.get_overlap_scores(token_ids)

        scores = self._call(query())
        return max((int(w.get("device_blocks", 0)) for w in scores["workers"]), default=0)

    def credited(self, token_ids: list[int]) -> dict[str, int]:
        """Leading blocks of ``token_ids`` each consumer credits the engine with."""
        return {"router": self._router_query(token_ids), "indexer": self._indexer_query(token_ids)}

    def sync(self, timeout: float = 30) -> None:
        """Wait until both consumers applied every event published before this call."""
        self.sentinels += 1
        tokens = sentinel_tokens(self.sentinels, self.block_size)
        self.publish_sentinel(tokens)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n >= 1 for n in self.credited(tokens).values()):
                return
            time.sleep(0.05)
        raise TimeoutError(f"the consumers did not apply sentinel {self.sentinels}")

    def close(self) -> None:
        self.indexer.terminate()
        self.indexer.wait(10)
        try:
            self.publisher.shutdown()
            self.runtime.shutdown()
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
