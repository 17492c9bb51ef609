"""``vllm-prefix-guard``: what an operator runs to see the guard will apply."""

from __future__ import annotations

import json

import pytest

from native_fix import simulate_native_fix
from vllm_prefix_guard import __version__, plugin
from vllm_prefix_guard.cli import main


def doctor_json(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, dict[str, dict]]:
    status = main(["doctor", "--json", *args])
    return status, {c["name"]: c for c in json.loads(capsys.readouterr().out)}


def test_doctor_passes_and_self_test_shows_the_fix(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    status, checks = doctor_json(capsys, "--self-test")
    assert status == 0
    assert checks["entry point"]["ok"]
    assert checks["vllm-prefix-guard"]["detail"] == __version__
    assert checks["guard"]["detail"].startswith("ON for a vLLM server")
    self_test = checks["self-test (priority zombie layout)"]
    assert self_test["ok"] and "guarded wrong reads=0" in self_test["detail"]
    assert "stock wrong reads=0" not in self_test["detail"]
    assert not plugin.is_applied()  # doctor leaves the process as it found it


def test_doctor_says_off_plainly_when_the_variable_is_unset(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(plugin.ENV_VAR, raising=False)
    status, checks = doctor_json(capsys)
    assert status == 0
    assert checks["guard"]["status"] == "info"
    assert checks["guard"]["detail"].startswith("OFF for a vLLM server")
    assert "VLLM_PREFIX_GUARD=1" in checks["guard"]["detail"]


def test_doctor_flags_a_bad_setting_and_says_why_the_self_test_was_skipped(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "maybe")
    assert main(["doctor", "--self-test"]) == 1
    out = capsys.readouterr().out
    assert "[FAIL] VLLM_PREFIX_GUARD: VLLM_PREFIX_GUARD='maybe' is not understood" in out
    assert "[skip] self-test: not run: 2 check(s) above failed" in out


def test_version_and_plain_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"vllm-prefix-guard {__version__}"
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = capsys.readouterr().out
    assert "``" not in help_text and ":mod:" not in help_text
    assert "Exit status:" in help_text and "doctor" in help_text and "fuzz" in help_text


def test_doctor_reports_which_upstream_fix_it_found(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, checks = doctor_json(capsys)
    assert checks["upstream fix"]["detail"] == "none in this vLLM: the guard patches it"
    simulate_native_fix(monkeypatch, remove_entry=None)
    status, checks = doctor_json(capsys)
    assert status == 1
    assert checks["upstream fix"]["status"] == "FAIL"
    assert "no BlockPool.remove_uncommitted_entry" in checks["upstream fix"]["detail"]
    simulate_native_fix(monkeypatch)
    status, checks = doctor_json(capsys)
    assert checks["upstream fix"]["status"] == "info"
    assert checks["upstream fix"]["detail"].endswith("the guard stays out")
