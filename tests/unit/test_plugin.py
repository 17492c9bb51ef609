"""Activation: the environment switch, idempotency, VLLM_PLUGINS, loud failure, undo."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import vllm
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from native_fix import METHODS, simulate_native_fix, simulate_pr43569
from vllm_prefix_guard import __version__, plugin, targets
from vllm_prefix_guard.errors import GuardConfigError, GuardUnsupportedError
from vllm_prefix_guard.hooks import GUARD_ATTR, guard_of
from vllm_prefix_guard.log import LOGGER_NAME
from vllm_prefix_guard.patches import PATCHES
from vllm_prefix_guard.plugin import ENV_VAR
from vllm_prefix_guard_harness.factory import make_scheduler

STOCK_SCHEDULE = Scheduler.__dict__["schedule"]
#: Every row of the patch table, as its start-up log line names it.
PATCHED = [p.label() for p in PATCHES]


@pytest.fixture
def guard_log() -> Iterator[list[str]]:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    log = logging.getLogger(LOGGER_NAME)
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    yield records
    log.removeHandler(handler)
    log.setLevel(old_level)


@pytest.mark.parametrize("value", ["1", "true", "ON", " on "])
def test_on_values_apply(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    plugin.register()
    # The scheduler and the pool only: /metrics goes through prometheus_client's own
    # channels (test_metrics.py), nothing of vLLM's metrics is patched.
    assert plugin.is_applied() and plugin.applied_targets() == PATCHED


@pytest.mark.parametrize("value", [None, "", "0", "false", "OFF"])
def test_off_values_do_nothing(monkeypatch: pytest.MonkeyPatch, value: str | None) -> None:
    if value is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, value)
    plugin.register()
    assert not plugin.is_applied() and Scheduler.__dict__["schedule"] is STOCK_SCHEDULE


@pytest.mark.parametrize("value", ["yes", "2", "enabled"])
def test_bad_values_name_the_variable_and_the_choices(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(GuardConfigError, match=rf"{ENV_VAR}=.*1, true, on.*0, false, off"):
        plugin.register()
    assert not plugin.is_applied()


def test_register_is_idempotent_and_logs_once_per_target(
    monkeypatch: pytest.MonkeyPatch, guard_log: list[str]
) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    plugin.register()
    first = Scheduler.__dict__["schedule"]
    plugin.register()
    plugin.register()
    assert Scheduler.__dict__["schedule"] is first
    patched_lines = [line for line in guard_log if "patched" in line]
    assert len(patched_lines) == len(plugin.applied_targets())
    assert all(f"vLLM {vllm.__version__}" in line for line in patched_lines)
    assert all(line.startswith(f"vllm-prefix-guard {__version__}: ") for line in patched_lines)


def test_concurrent_registration_patches_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    errors: list[BaseException] = []

    def call() -> None:
        try:
            plugin.register()
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and plugin.is_applied()


def _load_general_plugins(monkeypatch: pytest.MonkeyPatch, allowed: str | None) -> None:
    import vllm.plugins

    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()


@pytest.mark.parametrize(
    ("allowed", "applied"),
    [(None, True), ("prefix_guard", True), ("some_other_plugin", False), ("", False)],
)
def test_vllm_loader_honours_vllm_plugins(
    monkeypatch: pytest.MonkeyPatch, allowed: str | None, applied: bool
) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    _load_general_plugins(monkeypatch, allowed)
    assert plugin.is_applied() is applied


def test_enabling_through_vllm_loader_guards_new_schedulers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV_VAR, "1")
    _load_general_plugins(monkeypatch, None)
    assert guard_of(make_scheduler()) is not None


def test_missing_target_fails_loudly_at_startup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(Scheduler, "_preempt_request")
    monkeypatch.setenv(ENV_VAR, "1")
    with pytest.raises(GuardUnsupportedError) as excinfo:
        _load_general_plugins(monkeypatch, None)
    message = str(excinfo.value)
    assert "Scheduler._preempt_request does not exist" in message
    assert vllm.__version__ in message and "VLLM_PREFIX_GUARD=0" in message
    assert not plugin.is_applied() and Scheduler.__dict__["schedule"] is STOCK_SCHEDULE


def test_changed_signature_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    def update_from_output(self: Any, outputs: Any) -> None:  # pragma: no cover
        return None

    monkeypatch.setattr(Scheduler, "update_from_output", update_from_output)
    with pytest.raises(GuardUnsupportedError, match="no longer takes scheduler_output"):
        plugin.apply()
    assert Scheduler.__dict__["schedule"] is STOCK_SCHEDULE


def test_upstream_fix_present_skips_the_guard(
    monkeypatch: pytest.MonkeyPatch, guard_log: list[str]
) -> None:
    simulate_native_fix(monkeypatch)
    assert plugin.apply() == []
    assert not plugin.is_applied()
    assert Scheduler.__dict__["schedule"] is STOCK_SCHEDULE
    assert sum("already ships its own fix" in line for line in guard_log) == 1
    assert targets.native_fix().complete
    assert "FailedKVLoads.roll_back" in targets.native_fix().describe()


HALF_SIMILAR: dict[str, dict[str, Any]] = {
    "rollback only": {"methods": {"rollback_preempted": METHODS["rollback_preempted"]}},
    "other parameters": {
        "methods": {**METHODS, "rollback_preempted": lambda self, request_id: None}
    },
    "not a method": {"methods": {**METHODS, "commit_step": None}},
    "no exact removal on the pool": {"remove_entry": None},
    "not wired into the scheduler": {"wired": False},
    "the commit fence without the failed-load rollback": {"failed_kv_loads": False},
    "parts 1-2 without the KV-event rule": {"kv_events": False},
}


@pytest.mark.parametrize("shape", HALF_SIMILAR.values(), ids=HALF_SIMILAR.keys())
def test_half_similar_upstream_change_is_not_mistaken_for_the_fix(
    monkeypatch: pytest.MonkeyPatch, shape: dict[str, Any]
) -> None:
    """A vLLM with part of the native fix's API, or its names in another shape: the guard
    neither steps aside (nothing would fix the bug) nor patches beside it (two mechanisms
    over one index); it refuses to start, naming what it found."""
    simulate_native_fix(monkeypatch, **shape)
    assert not targets.native_fix().complete
    assert targets.native_fix().partial
    with pytest.raises(GuardUnsupportedError, match=r"UncommittedPrefixCache.*VLLM_PREFIX_GUARD=0"):
        plugin.apply()
    assert not plugin.is_applied()
    assert Scheduler.__dict__["schedule"] is STOCK_SCHEDULE


@pytest.mark.parametrize("owner", [KVCacheManager, BlockPool], ids=lambda c: c.__name__)
def test_pr43569s_shape_is_refused(monkeypatch: pytest.MonkeyPatch, owner: type) -> None:
    """Upstream PR #43569's API (on the manager; on the pool in its first revision) is
    another fix with known gaps: the guard neither steps aside for it nor runs beside it."""
    simulate_pr43569(monkeypatch, owner, "rollback_uncommitted")
    fix = targets.native_fix()
    assert fix.partial and f"{owner.__name__}.rollback_uncommitted" in fix.present
    with pytest.raises(GuardUnsupportedError, match=rf"{owner.__name__}\.rollback_uncommitted"):
        plugin.apply()
    simulate_native_fix(monkeypatch)  # both shapes at once: still refused
    assert targets.native_fix().partial


def test_stock_vllm_has_none_of_the_native_fix() -> None:
    fix = targets.native_fix()
    assert fix.present == () and not fix.partial and not fix.complete


def test_undo_restores_stock_vllm() -> None:
    plugin.apply()
    assert Scheduler.__dict__["schedule"] is not STOCK_SCHEDULE
    plugin.undo()
    assert Scheduler.__dict__["schedule"] is STOCK_SCHEDULE
    assert "__setattr__" not in vars(KVCacheCoordinator)
    assert GUARD_ATTR not in vars(Scheduler)
    assert BlockPool.__dict__["cache_full_blocks"].__name__ == "cache_full_blocks"
    assert not hasattr(BlockPool.__dict__["cache_full_blocks"], "__wrapped__")
    assert "uncommitted_entries" not in vars(BlockPool)
    assert "rewind_num_cached_blocks" not in vars(KVCacheManager)
    assert guard_of(make_scheduler()) is None


def test_fresh_process_needs_only_the_environment() -> None:
    """What vLLM does in a new EngineCore process (``run_engine_core``): configure logging,
    then ``load_general_plugins()`` in ``EngineCore.__init__``; nothing else."""
    import os
    import subprocess
    import sys

    code = (
        "try:\n"
        "    from vllm.config.logging import LoggingConfig\n"
        "    from vllm.logger import configure_logging\n"
        "except ImportError:\n"  # vLLM 0.30: vllm.logger configures itself on import
        "    import vllm.logger\n"
        "else:\n"
        "    configure_logging(LoggingConfig())\n"
        "import vllm.plugins\n"
        "vllm.plugins.load_general_plugins()\n"
        "from vllm_prefix_guard import plugin\n"
        "from vllm_prefix_guard.hooks import guard_of\n"
        "from vllm_prefix_guard_harness.factory import make_scheduler\n"
        "assert plugin.is_applied(), 'guard not applied'\n"
        "assert guard_of(make_scheduler()) is not None, 'no guard'\n"
        "print('guarded')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "VLLM_PLUGINS"}
    env[ENV_VAR] = "1"
    env["VLLM_LOGGING_LEVEL"] = "INFO"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "guarded" in result.stdout
    assert f"vllm-prefix-guard {__version__}: patched Scheduler.schedule" in (
        result.stdout + result.stderr
    )
