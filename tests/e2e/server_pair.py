"""The types of the e2e fixtures (``conftest.py``), importable by the test modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from guard_demo.server import ApiServer

#: ``launch_server(name, *, guard, stats_file=None, **serve_kwargs)``: a started server.
LaunchServer = Callable[..., ApiServer]


@dataclass(frozen=True)
class Servers:
    """A guarded server and a reference (no prefix caching, guard unset) for the same model."""

    guarded: ApiServer
    reference: ApiServer
    #: ``VLLM_PREFIX_GUARD_STATS_FILE`` of the guarded server.
    stats_file: Path
