"""pytest plugin for running vLLM's own test suite with or without the guard.

Loaded with ``-p prefix_guard_pytest`` (this directory on ``PYTHONPATH``) into a pytest
run over vLLM's ``tests/`` (see run_vllm_suite.py). It applies the guard the way a
user's process gets it: ``VLLM_PREFIX_GUARD`` decides, and the guard is installed by
vLLM's own ``load_general_plugins()``, which calls every ``vllm.general_plugins`` entry
point, ours included. vLLM calls that in each process it starts (engine core,
workers), but most unit tests build a ``Scheduler`` or ``KVCacheManager`` directly and
never reach it, so this plugin calls it once at start-up, before any test module is
imported. Subprocesses the tests start inherit ``VLLM_PREFIX_GUARD`` and load the
guard through vLLM's own call.

Both modes load this plugin (``VLLM_PREFIX_GUARD=0`` for stock), so the two runs differ
in that variable only. The plugin fails the run if the guard's state does not match
the variable, at start-up and again at the end (a test that undid the patches would
otherwise make the guarded run silently stock).

``--prefix-guard-report PATH`` writes a JSON file: the mode, the patched targets, each
test's outcome, wall and CPU time, and (guarded) the node ids of the tests during which
the guard attached itself to a scheduler (and its pool), i.e. the tests that
exercised it.
"""

from __future__ import annotations

import gc
import json
import os
import time
from typing import Any

import pytest

GUARD_ENV = "VLLM_PREFIX_GUARD"

_exercised: set[str] = set()
_outcomes: dict[str, str] = {}
# Per test: [wall seconds, CPU seconds of this process] over setup, call and teardown.
_times: dict[str, list[float]] = {}
_guards_attached = 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--prefix-guard-report",
        default=None,
        help="write the guard's mode, patched targets and exercising tests here (JSON)",
    )
    parser.addoption(
        "--cleanup-without-gc",
        action="store_true",
        help="after each test, run vLLM's cleanup_dist_env_and_memory() without its "
        "gc.collect() (most of these unit tests' run time)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """With ``--cleanup-without-gc``, vLLM's own teardown is skipped (its
    ``skip_global_cleanup`` marker) and ``pytest_runtest_teardown`` below runs it instead,
    without the collection."""
    if config.getoption("--cleanup-without-gc"):
        for item in items:
            item.add_marker(pytest.mark.skip_global_cleanup)


class _NoCollect:
    """The ``gc`` module, except that ``collect()`` does nothing."""

    def __getattr__(self, name: str) -> Any:
        return getattr(gc, name)

    @staticmethod
    def collect(*args: Any, **kwargs: Any) -> int:
        return 0


def _cleanup_without_gc() -> None:
    """vLLM's ``cleanup_dist_env_and_memory()`` (env cache, ``gc.unfreeze()``, model
    parallel groups, distributed environment, accelerator caches), its collection off."""
    from vllm.distributed import parallel_state

    module_gc = parallel_state.gc
    parallel_state.gc = _NoCollect()  # type: ignore[assignment]
    try:
        parallel_state.cleanup_dist_env_and_memory()
    finally:
        parallel_state.gc = module_gc


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    try:
        return (yield)
    finally:
        if item.config.getoption("--cleanup-without-gc"):
            _cleanup_without_gc()


def _expect_guard() -> bool:
    from vllm_prefix_guard import plugin

    return plugin.enabled_by_env()


def _count_guard_use() -> None:
    """Count schedulers given a guard (a pool no guard attached to runs vLLM's own code:
    the guard's wrappers on ``BlockPool`` pass every call through)."""
    from vllm_prefix_guard import hooks

    attach_guard = hooks.attach_guard

    def counting_attach_guard(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
        global _guards_attached
        guard = attach_guard(scheduler, *args, **kwargs)
        _guards_attached += guard is not None
        return guard

    hooks.attach_guard = counting_attach_guard


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(GUARD_ENV, "0")
    from vllm.plugins import load_general_plugins

    from vllm_prefix_guard import plugin

    load_general_plugins()  # what vLLM does in every process it starts
    expected = _expect_guard()
    if plugin.is_applied() != expected:
        raise pytest.UsageError(
            f"{GUARD_ENV}={os.environ[GUARD_ENV]!r} but the guard is "
            f"{'applied' if plugin.is_applied() else 'not applied'} after "
            "vllm.plugins.load_general_plugins(): is vllm-prefix-guard installed in this "
            "venv (entry point vllm.general_plugins:prefix_guard) and VLLM_PLUGINS unset?"
        )
    if expected:
        _count_guard_use()


def pytest_report_header(config: pytest.Config) -> str:
    from vllm_prefix_guard import __version__, plugin

    if plugin.is_applied():
        return (
            f"vllm-prefix-guard {__version__}: APPLIED via load_general_plugins "
            f"({len(plugin.applied_targets())} targets)"
        )
    return f"vllm-prefix-guard {__version__}: not applied ({GUARD_ENV}=0, stock vLLM)"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    used_before = _guards_attached
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        return (yield)
    finally:
        _times[item.nodeid] = [
            round(time.perf_counter() - wall, 3),
            round(time.process_time() - cpu, 3),
        ]
        if _guards_attached != used_before:
            _exercised.add(item.nodeid)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A file that fails to import counts as one errored "test" named after the file."""
    if report.failed:
        _outcomes[report.nodeid] = "error"


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One outcome per test: passed, failed, error (setup/teardown), skipped, xfailed,
    xpassed; a failing teardown turns a pass into an error."""
    nodeid = report.nodeid
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
        _outcomes[nodeid] = outcome
    elif report.when == "setup":
        if report.failed:
            _outcomes[nodeid] = "error"
        elif report.skipped:
            _outcomes[nodeid] = "xfailed" if hasattr(report, "wasxfail") else "skipped"
    elif report.failed and _outcomes.get(nodeid) != "failed":  # teardown
        _outcomes[nodeid] = "error"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    from vllm_prefix_guard import plugin

    expected = _expect_guard()
    path = session.config.getoption("--prefix-guard-report")
    if path:
        report = {
            "mode": "guard" if expected else "stock",
            "guard_state_ok": plugin.is_applied() == expected,
            "patched_targets": plugin.applied_targets(),
            "guards_attached": _guards_attached,
            "exercised": sorted(_exercised),
            "outcomes": _outcomes,
            "times": _times,
        }
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
    if plugin.is_applied() != expected:
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line("vllm-prefix-guard: the guard's state changed during the run", red=True)
