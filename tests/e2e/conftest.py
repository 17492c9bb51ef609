"""Fixtures for the end-to-end tests: the tiny model and api_server processes.

Servers are started through :class:`guard_demo.server.ApiServer`, each in its own
process group on a free loopback port, and every server a fixture starts is stopped (SIGTERM, then
SIGKILL to the whole group) in that fixture's finalizer, whether the tests passed or not.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_pair import LaunchServer, Servers

from guard_demo.server import (
    GUARDED_NUM_GPU_BLOCKS,
    REFERENCE_NUM_GPU_BLOCKS,
    STARTUP_TIMEOUT_S,
    ApiServer,
)
from guard_demo.tiny_model import generate_tiny_model

# vLLM's CPU backend sizes its KV cache from this (GiB); the tests override the block count.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny Llama checkpoint, generated once per session."""
    return generate_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def launch_server(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LaunchServer]:
    """Start api_servers (not waiting for them); all are stopped when the module ends.

    The returned callable takes a name (for the log directory) and the keywords of
    :meth:`ApiServer.for_model`: ``guard`` (the value of ``VLLM_PREFIX_GUARD``, or ``None`` to
    leave it unset), ``stats_file``, and :func:`~guard_demo.server.serve_args` keywords.
    """
    servers: list[ApiServer] = []

    def launch(name: str, *, guard: str | None, **serve_kwargs: Any) -> ApiServer:
        log_path = tmp_path_factory.mktemp(name) / "server.log"
        server = ApiServer.for_model(tiny_model, log_path, guard=guard, **serve_kwargs)
        servers.append(server)
        server.start()
        return server

    try:
        yield launch
    finally:
        for server in servers:
            server.stop()


@pytest.fixture(scope="module")
def guarded_server_options() -> dict[str, Any]:
    """:func:`~guard_demo.server.serve_args` keywords of the module's guarded server; a
    module that needs another one (a KV connector, a larger cache) overrides this fixture."""
    return {"num_gpu_blocks": GUARDED_NUM_GPU_BLOCKS}


@pytest.fixture(scope="module")
def servers(
    launch_server: LaunchServer,
    tmp_path_factory: pytest.TempPathFactory,
    guarded_server_options: dict[str, Any],
) -> Servers:
    """The guarded server (``VLLM_PREFIX_GUARD=1``, prefix caching, a stats file) and the
    reference, started side by side and healthy; stopped when the module ends."""
    stats_file = tmp_path_factory.mktemp("guard-stats") / "stats.json"
    guarded = launch_server(
        "guarded", guard="1", stats_file=stats_file, prefix_caching=True, **guarded_server_options
    )
    reference = launch_server(
        "reference", guard=None, prefix_caching=False, num_gpu_blocks=REFERENCE_NUM_GPU_BLOCKS
    )
    guarded.wait_healthy(STARTUP_TIMEOUT_S)
    reference.wait_healthy(STARTUP_TIMEOUT_S)
    return Servers(guarded, reference, stats_file)
