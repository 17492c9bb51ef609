"""The CI differential run, computed once per session and shared by the acceptance tests.

Sized for CI (issue 3: the whole fuzz suite in about 90 s per vLLM version on two
cores): every configuration on seeds 0-2 at its CI horizon, in all three modes. The
table is printed at the end of the session, so CI logs show the figures.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from vllm_prefix_guard_harness.fuzz.configs import CONFIGS, runnable
from vllm_prefix_guard_harness.fuzz.differential import ConfigResult, run_matrix

CI_SEEDS = range(3)


class CIResults(dict[str, ConfigResult]):
    """Configuration name -> its results; a configuration this vLLM cannot judge the
    guard on (``FuzzConfig.unavailable``) skips the test that asks for it, saying why."""

    skipped: dict[str, str] = {}

    def __missing__(self, name: str) -> ConfigResult:
        pytest.skip(f"{name}: {self.skipped[name]}")


_results = CIResults()


@pytest.fixture(scope="session")
def ci_results() -> Iterator[dict[str, ConfigResult]]:
    """Configuration name -> its totals over ``CI_SEEDS``, all modes."""
    if not _results:
        from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm

        quiet_vllm()
        configs, CIResults.skipped = runnable(list(CONFIGS.values()))
        for result in run_matrix(configs, CI_SEEDS):
            _results[result.config.name] = result
    yield _results


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _results:
        return
    from vllm_prefix_guard.targets import vllm_version
    from vllm_prefix_guard_harness.fuzz.report import checks_text, markdown_table

    results = list(_results.values())
    terminalreporter.section(f"fuzz: stock vs guard vs pr43569 (vLLM {vllm_version()})")
    terminalreporter.write_line(markdown_table(results))
    terminalreporter.write_line("")
    terminalreporter.write_line(checks_text(results))
