"""``vllm-prefix-guard-harness fuzz``: the differential fuzzer from a shell."""

from __future__ import annotations

import json

import pytest

from vllm_prefix_guard import plugin
from vllm_prefix_guard_harness.cli import main


def test_json_run_reports_exposure_and_exits_zero(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["fuzz", "--seeds", "1", "--config", "victim", "--json", "--shrink-seconds", "0"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    [victim] = report["configs"]
    assert report["ok"] and victim["ok"]
    assert victim["modes"]["stock"]["violations"] > 0
    assert victim["modes"]["guard"]["violations"] == 0
    assert set(victim["modes"]) == {"stock", "guard", "pr43569"}
    assert not plugin.is_applied()


def test_guarded_violation_exits_nonzero_with_a_reproducer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A guard that does nothing (its rollback disabled) must be caught and shrunk."""
    from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache

    monkeypatch.setattr(UncommittedPrefixCache, "rollback_preempted", lambda self, *args: None)
    argv = ["fuzz", "--seeds", "1", "--config", "victim", "--modes", "stock,guard"]
    assert main([*argv, "--shrink-seconds", "30"]) == 1
    out = capsys.readouterr().out
    assert "guard READ BAD KV in: victim" in out
    assert "# Minimal reproducer: victim, bad KV read in mode 'guard'" in out
    assert "WORKLOAD = Workload(" in out


def test_lists_configurations(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["fuzz", "--list"]) == 0
    assert "victim [targeted]" in capsys.readouterr().out
