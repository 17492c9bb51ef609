"""Explorations shared by the tests of one session (each costs seconds of forks), and
their table at the end of the session, so CI logs show the figures."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from vllm_prefix_guard_harness.explore.search import SearchResult

Explore = Callable[[str, tuple[str, ...]], SearchResult]

_results: dict[tuple[str, tuple[str, ...]], SearchResult] = {}


@pytest.fixture(scope="session")
def explored() -> Explore:
    """``explored(scope name, modes)``: that exploration, run on first use."""
    from vllm_prefix_guard_harness.explore.scope import SCOPES
    from vllm_prefix_guard_harness.explore.search import explore
    from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

    quiet_vllm()

    def run(scope: str, modes: tuple[str, ...]) -> SearchResult:
        key = (scope, modes)
        if key not in _results:
            _results[key] = explore(SCOPES[scope], modes)
        return _results[key]

    return run


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _results:
        return
    from vllm_prefix_guard.targets import vllm_version
    from vllm_prefix_guard_harness.explore.report import table

    terminalreporter.section(f"explore (vLLM {vllm_version()})")
    terminalreporter.write_line(table(list(_results.values())))
