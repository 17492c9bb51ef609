"""``python -m guard_demo``, end to end, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from guard_demo.processes import live_pids

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_demo_passes_and_cleans_up(tiny_model: Path, tmp_path: Path) -> None:
    """The demo reports every figure, finds no mismatch, and leaves no server process behind."""
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "guard_demo",
            "--requests",
            "24",
            "--model-dir",
            str(tiny_model),
            "--log-dir",
            str(tmp_path),
        ],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "examples")},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout
    assert result.returncode == 0, report + result.stderr[-3000:]
    assert re.search(r"requests\s+24 sent", report), report
    assert re.search(r"prefix-cache hits\s+\d+\.\d%", report), report
    assert re.search(r"preemptions\s+\d+", report), report
    assert re.search(r"guard rollbacks\s+\d+", report), report  # a number, not "n/a"
    assert re.search(r"mismatches\s+0 ", report), report
    assert (tmp_path / "guard-stats.json").exists()
    assert live_pids(cmdline_contains=str(tiny_model)) == []
