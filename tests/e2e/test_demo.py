"""``python -m guard_demo``, end to end, as a user runs it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from guard_demo.processes import live_pids
from guard_demo.server import shutdown_problems

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HARNESS = str(Path(__file__).resolve().parents[2] / "harness")
# Kept after it: a checkout's src/ put there (to run a worktree's guard) must reach the demo.
PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def test_demo_passes_and_cleans_up(tiny_model: Path, tmp_path: Path) -> None:
    """The demo opens with the engine-level proof (stock diverging, the guard matching), then
    reports every figure of the server, finds no mismatch, stops its servers cleanly, says
    where its logs and model are, and leaves no server process behind."""
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
        env={**os.environ, "PYTHONPATH": os.pathsep.join([HARNESS, *PYTHONPATH])},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout
    assert result.returncode == 0, report + result.stderr[-3000:]
    # It opens with the engine-level proof, both ways.
    lines = report[report.index("vllm-prefix-guard demo (") :].splitlines()
    assert lines[1].startswith("1. the bug and the fix on one engine"), report
    assert re.search(r"stock vLLM\s+C hits 288 tokens, block 9 that A never wrote", report)
    assert re.search(r"\n\s+C: from output token \d+ .*logprob off by \d+\.\d\d\n", report)
    assert re.search(r"with the guard\s+C hits 256 tokens .*all 4 completions within", report)
    assert "verdict           OK: stock read never-written KV, the guard did not" in report
    assert re.search(r"\n2\. the server under load", report), report
    assert (tmp_path / "engine-proof.json").exists()
    assert re.search(r"requests\s+24 sent", report), report
    assert re.search(r"prefix-cache hits\s+\d+\.\d%", report), report
    assert re.search(r"preemptions\s+\d+", report), report
    assert re.search(r"guard rollbacks\s+\d+", report), report  # a number, not "n/a"
    assert re.search(r"mismatches\s+0 ", report), report
    assert re.search(r"per engine .*\n\s+engine 0: hits \d+\.\d%", report), report
    assert (tmp_path / "guard-stats.engine0.json").exists()
    assert live_pids(cmdline_contains=str(tiny_model)) == []
    # It says where its logs and its model are, at start and in the report.
    assert f"model: {tiny_model}\nserver logs: {tmp_path}\n" in report
    assert re.search(rf"server logs\s+{re.escape(str(tmp_path))}\n", report), report
    assert re.search(rf"model\s+{re.escape(str(tiny_model))}\n", report), report
    # Both servers stopped the way vLLM expects: no traceback (but vLLM's own known race,
    # named as such), no force-kill in their logs.
    shutdown = r"shutdown\s+(clean|orderly \(no force-kill\), with vLLM's known)"
    assert re.search(shutdown, report), report
    assert "force-killing" not in result.stderr
    for log in ("guarded-server.log", "reference-server.log"):
        assert shutdown_problems((tmp_path / log).read_text()) == [], log
