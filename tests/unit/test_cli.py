"""``vllm-prefix-guard``: what an operator runs to see the guard will apply."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest

from native_fix import simulate_native_fix
from vllm_prefix_guard import __version__, plugin
from vllm_prefix_guard.cli import main
from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.metrics import RUN_DIR_ENV
from vllm_prefix_guard.stats import STATS_FILE_ENV


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
    assert self_test["ok"] and self_test["detail"].endswith("guarded 0")
    assert "stock 0," not in self_test["detail"]
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


#: Settings a guarded server refuses to start with: (variable, path under a scratch
#: directory, what the error says).
UNUSABLE = {
    "stats-file-in-a-missing-directory": (
        STATS_FILE_ENV,
        "missing/guard-{engine}.json",
        "does not exist",
    ),
    "inherited-run-directory-gone": (RUN_DIR_ENV, "gone", "not a writable"),
}


@pytest.mark.parametrize(("variable", "path", "named"), UNUSABLE.values(), ids=UNUSABLE.keys())
def test_doctor_fails_where_the_server_refuses_to_start(
    variable: str,
    path: str,
    named: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    """What the server's start-up (``register()``) refuses, doctor fails, with the server's
    own message; with the guard off the server starts, and doctor says what would happen."""
    monkeypatch.setenv(variable, str(tmp_path / path))
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    with pytest.raises(GuardConfigError) as refused:
        plugin.register()
    assert named in str(refused.value)
    status, checks = doctor_json(capsys)
    assert status == 1
    assert checks[variable] == {
        "name": variable,
        "status": "FAIL",
        "detail": str(refused.value),
        "ok": False,
    }
    monkeypatch.delenv(plugin.ENV_VAR)
    status, checks = doctor_json(capsys)
    assert status == 0
    assert checks[variable]["status"] == "info"
    assert checks[variable]["detail"].startswith(
        "with VLLM_PREFIX_GUARD=1 a server would refuse to start: "
    )
    assert checks[variable]["detail"].endswith(str(refused.value))


def test_doctor_fails_without_a_writable_temporary_directory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The run directory is made in the temporary directory: none usable, no server."""
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "no-such-tmp"))
    status, checks = doctor_json(capsys)
    assert status == 1
    assert checks[RUN_DIR_ENV]["status"] == "FAIL"
    assert "TMPDIR" in checks[RUN_DIR_ENV]["detail"]


def test_doctor_passes_usable_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path / "guard-{engine}.json"))
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    status, checks = doctor_json(capsys)
    assert status == 0
    assert checks[STATS_FILE_ENV]["detail"].endswith("its directory is writable")
    assert checks[RUN_DIR_ENV]["detail"].endswith("inherited, writable")


def test_doctor_fails_when_the_guard_is_asked_for_and_vllm_would_not_load_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Never unguarded in silence: ``VLLM_PREFIX_GUARD=1`` with a ``VLLM_PLUGINS`` list that
    leaves the plugin out (vLLM would not load it) is a failure, with the fix."""
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    status, checks = doctor_json(capsys)
    assert status == 1
    guard = checks["guard"]
    assert guard["status"] == "FAIL" and "would serve unguarded" in guard["detail"]
    assert "Add prefix_guard to VLLM_PLUGINS" in guard["detail"]
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin,prefix_guard")
    assert doctor_json(capsys)[0] == 0


def test_doctor_refuses_a_stats_path_that_is_a_directory(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setenv(STATS_FILE_ENV, str(tmp_path))
    status, checks = doctor_json(capsys)
    assert status == 1
    assert "is a directory; name a file in it" in checks[STATS_FILE_ENV]["detail"]
    with pytest.raises(GuardConfigError, match="is a directory"):
        plugin.register()


def test_doctor_text_puts_failures_first_and_ends_with_its_verdict(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[-1] == "verdict: ok: a vLLM server started from this shell starts, the guard ON"
    assert [line for line in lines if "] internal " in line] == []  # folded into one line
    assert any(line.startswith("[  ok] internals: all ") for line in lines)
    assert main(["doctor", "--verbose"]) == 0
    assert sum("] internal " in line for line in capsys.readouterr().out.splitlines()) > 60
    monkeypatch.setenv("VLLM_PLUGINS", "some_other_plugin")
    assert main(["doctor"]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("[FAIL] guard: ")
    assert lines[-1].startswith("verdict: 1 FAIL (guard): ")


def test_doctor_fails_where_vllm_would_never_run_the_plugin(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other ways vLLM would serve unguarded: the entry point is missing, or this vLLM
    no longer loads the plugin group it is in."""
    import vllm.plugins

    from vllm_prefix_guard import doctor

    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(doctor, "entry_points", lambda group: [])
    status, checks = doctor_json(capsys)
    assert status == 1 and checks["entry point"]["status"] == "FAIL"
    monkeypatch.undo()
    monkeypatch.setenv(plugin.ENV_VAR, "1")
    monkeypatch.setattr(vllm.plugins, "DEFAULT_PLUGINS_GROUP", "vllm.other_plugins")
    status, checks = doctor_json(capsys)
    assert status == 1
    assert "would never run the guard" in checks["vLLM plugin loader"]["detail"]
