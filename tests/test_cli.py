"""``vllm-prefix-guard doctor``: what an operator runs to see the guard will apply."""

from __future__ import annotations

import json

import pytest

from vllm_prefix_guard import plugin
from vllm_prefix_guard.cli import main


def test_doctor_passes_and_self_test_shows_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--self-test", "--json"]) == 0
    checks = {c["check"]: c for c in json.loads(capsys.readouterr().out)}
    assert checks["entry point registered"]["ok"]
    self_test = checks["self-test (priority zombie layout)"]
    assert self_test["ok"] and "guarded wrong reads=0" in self_test["detail"]
    assert "stock wrong reads=0" not in self_test["detail"]
    assert not plugin.is_applied()  # doctor leaves the process as it found it


def test_doctor_flags_a_bad_setting(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "maybe")
    assert main(["doctor"]) == 1
    assert "[FAIL] VLLM_PREFIX_GUARD valid" in capsys.readouterr().out
