"""Shared fixtures: an offline vLLM, and the guard switched on or off per test."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import pytest

# Offline, quiet, and a model-info cache per vLLM build (the venvs would overwrite each
# other's cache file and pay the ~12 s cold inspection every time).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import vllm

os.environ.setdefault(
    "VLLM_CACHE_ROOT",
    os.path.join(tempfile.gettempdir(), f"vllm-prefix-guard-cache-{vllm.__version__}"),
)

from native_fix import INSTALLED as NATIVE_FIX_INSTALLED
from vllm_prefix_guard import plugin
from vllm_prefix_guard.metrics import RUN_DIR_ENV


@pytest.fixture(autouse=True)
def _stock_between_tests() -> Iterator[None]:
    """Every test starts and ends on stock vLLM, whatever it did in between (a test that
    registers the plugin also leaves no run directory behind for later schedulers)."""
    plugin.undo()
    run_dir = os.environ.get(RUN_DIR_ENV)
    yield
    plugin.undo()
    if run_dir is None:
        os.environ.pop(RUN_DIR_ENV, None)
    else:
        os.environ[RUN_DIR_ENV] = run_dir


@pytest.fixture(params=["native"] if NATIVE_FIX_INSTALLED else ["stock", "guard"])
def mode(request: pytest.FixtureRequest) -> str:
    """Run a regression both ways: stock must fail, the guard must not. On a vLLM with
    its own fix, once (``native``): it must not fail, judged by the same oracle."""
    if request.param == "guard":
        plugin.apply()
    return str(request.param)


@pytest.fixture
def guard() -> None:
    plugin.apply()
