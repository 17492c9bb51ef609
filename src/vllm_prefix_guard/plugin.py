"""The ``vllm.general_plugins`` entry point: read ``VLLM_PREFIX_GUARD`` and apply the guard.

vLLM calls :func:`register` in every process it starts (API server, EngineCore,
workers), before the scheduler is built, and only if ``VLLM_PLUGINS`` allows the entry
point ``prefix_guard``. An exception raised here aborts engine start-up: that is how an
enabled guard that cannot apply fails loudly instead of running unguarded.

This module imports nothing from vLLM at import time, so a broken vLLM surfaces as the
guard's own error from :func:`register`, not as a swallowed entry-point import failure.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from vllm_prefix_guard import __version__
from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.log import logger
from vllm_prefix_guard.patches import PATCHES
from vllm_prefix_guard.patching import PatchRegistry

ENV_VAR = "VLLM_PREFIX_GUARD"
_ON = ("1", "true", "on")
_OFF = ("", "0", "false", "off")

_lock = threading.RLock()
_registry: PatchRegistry | None = None
_patched: list[str] = []
_skipped_for_upstream: str | None = None


def enabled_by_env() -> bool:
    """Parse ``VLLM_PREFIX_GUARD``: unset/0/false/off -> False, 1/true/on -> True.

    Raises:
        GuardConfigError: any other value, naming the variable and the accepted values.
    """
    raw = os.environ.get(ENV_VAR, "")
    value = raw.strip().lower()
    if value in _ON:
        return True
    if value in _OFF:
        return False
    raise GuardConfigError(
        f"{ENV_VAR}={raw!r} is not understood: use one of {', '.join(_ON)} to enable the "
        f"guard, or one of 0, false, off (or leave it unset) to disable it."
    )


def setting_checks() -> list[tuple[str, Callable[[], object]]]:
    """The checks of the guard's other settings, as ``(setting, run)``: :func:`register`
    runs them before anything else once the guard is on, and ``doctor`` reports them; each
    returns what it found or raises :class:`GuardConfigError`."""
    from vllm_prefix_guard import metrics, stats

    return [
        (stats.STATS_FILE_ENV, stats.check_stats_file_setting),
        (metrics.RUN_DIR_ENV, metrics.check_run_dir_setting),
    ]


def register() -> None:
    """Entry point for ``vllm.general_plugins``; idempotent and re-entrant.

    Raises:
        GuardConfigError: a guard setting is not understood (``VLLM_PREFIX_GUARD``) or
            points nowhere (``VLLM_PREFIX_GUARD_STATS_FILE``, the run directory).
        GuardUnsupportedError: the guard is on and this vLLM lacks an internal it needs.
    """
    if not enabled_by_env():
        return
    from vllm_prefix_guard import metrics

    for _, check in setting_checks():
        check()
    metrics.ensure_run_dir()
    apply()


def apply() -> list[str]:
    """Check every target, then patch them all; return the patched targets' names.

    Calling it again in the same process is a no-op that returns the same names. If the
    installed vLLM already has an equivalent fix, nothing is patched (logged once).

    Raises:
        GuardUnsupportedError: an internal is missing or changed; nothing was patched.
    """
    global _registry, _patched
    from vllm_prefix_guard import metrics, targets

    with _lock:
        if _registry is not None:
            return list(_patched)
        if _skipped_for_upstream is not None or _steps_aside():
            return []
        targets.check_all()
        registry = PatchRegistry()
        try:  # each patch imports its wrapper (and the rules) only now, after the checks
            patched = [p.apply(registry, targets.resolve(p.module, p.owner)) for p in PATCHES]
        except BaseException:
            registry.undo_all()
            raise
        _registry, _patched = registry, patched
        log, version = logger(), targets.vllm_version()
        for name in _patched:
            log.info("vllm-prefix-guard %s: patched %s (vLLM %s)", __version__, name, version)
        metrics.install()
        return list(_patched)


def _steps_aside() -> bool:
    """Whether the installed vLLM ships the whole fix itself (logged once: the guard
    stays out).

    Raises:
        GuardUnsupportedError: it has part of a fix, or another shape of it.
    """
    global _skipped_for_upstream
    from vllm_prefix_guard import targets

    native = targets.native_fix()
    if native.partial:
        raise targets.unsupported(
            f"vLLM's own prefix-cache rollback ({', '.join(native.present)})",
            f"is not the whole fix in the shape the guard recognises ({native.describe()}),"
            " so the guard will neither step aside for it (leaving the rest unguarded) "
            "nor run beside it",
            "Install a vLLM with the whole upstream series, or one with none of it.",
        )
    if not native.complete:
        return False
    _skipped_for_upstream = native.describe()
    logger().info(
        "vllm-prefix-guard %s: vLLM %s already ships its own fix (%s); the guard is not applied.",
        __version__,
        targets.vllm_version(),
        _skipped_for_upstream,
    )
    return True


def undo() -> None:
    """Restore stock vLLM in this process (pools keep the guard's state, unused)."""
    global _registry, _patched, _skipped_for_upstream
    with _lock:
        if _registry is not None:
            _registry.undo_all()
        _registry, _patched = None, []
        _skipped_for_upstream = None


def is_applied() -> bool:
    """Whether the guard's patches are in place in this process."""
    return _registry is not None


def applied_targets() -> list[str]:
    """Names of the targets patched in this process."""
    return list(_patched)
