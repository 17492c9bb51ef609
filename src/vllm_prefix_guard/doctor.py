"""``vllm-prefix-guard doctor``: will the guard be on, and can it apply to the installed vLLM?

Each :class:`Check` (``ok``, ``FAIL``, ``skip`` or ``info``) runs what the plugin runs at
start-up: the entry point, the settings, vLLM's own fix, every internal
(``targets.all_checks``), the pool kvcached swaps in. Where a server started from this shell
would refuse to start, a check fails (``doctor`` exits 1); what only the enabled guard refuses
is reported, not failed, while the guard is off. ``--self-test`` then runs the known failure
on stock and guarded schedulers of this very vLLM build (``selftest``, imported only then)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points

from vllm_prefix_guard import __version__, kvcached_support, plugin, pool, stats, targets
from vllm_prefix_guard.errors import GuardConfigError
from vllm_prefix_guard.patches import PATCHES
from vllm_prefix_guard.versions import TESTED_VLLM

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "prefix_guard"

OK, FAIL, SKIP, INFO = "ok", "FAIL", "skip", "info"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str

    @property
    def failed(self) -> bool:
        return self.status == FAIL

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "ok": not self.failed}

    def render(self) -> str:
        return f"[{self.status:>4}] {self.name}: {self.detail}"


def run_checks(self_test: bool) -> list[Check]:
    """Every check, in order. The self-test runs only if nothing failed before it."""
    checks = _install_checks()
    activation, guard_on = _activation_checks()
    checks += [*activation, *_setting_checks(guard_on), _upstream_check()]
    kvcached = kvcached_support.status()
    refused = kvcached.active and kvcached.variant == "legacy"
    kv = kvcached.describe()
    checks.append(_refused("kvcached", kv, guard_on) if refused else Check("kvcached", INFO, kv))
    owners = ", ".join(sorted({patch.owner for patch in PATCHES}))
    table = (
        f"{len(PATCHES)} patches on vLLM's {owners}, each with its why and its removal plan "
        "(docs/design.md, patch registry); every target is checked below"
    )
    checks.append(Check("patch table", INFO, table))
    internals = _internal_checks()
    checks += internals
    pool_class = kvcached.pool_class
    if kvcached.active and not refused and pool_class and not any(c.failed for c in internals):
        checks.append(_kvcached_pool_check(pool_class, guard_on))
    failed = sum(c.failed for c in checks)
    if self_test and failed:
        checks.append(Check("self-test", SKIP, f"not run: {failed} check(s) above failed"))
    elif self_test:
        checks.append(_self_test())
    return checks


def _upstream_check() -> Check:
    """vLLM's own fix: whole (the guard stays out), in part (it refuses to start), or none."""
    native = targets.native_fix()
    if native.partial:
        detail = f"partly there ({native.describe()}): the guard refuses to start beside it"
    elif native.complete:
        detail = f"{native.describe()}: the guard stays out"
    else:
        detail = "none in this vLLM: the guard patches it"
    return Check("upstream fix", FAIL if native.partial else INFO, detail)


def _kvcached_pool_check(pool_class: type, guard_on: bool) -> Check:
    """What the guard checks when it attaches to the pool kvcached swaps in."""
    name = f"kvcached pool {pool_class.__module__}.{pool_class.__qualname__}"
    try:
        pool.check_pool(pool_class)
    except Exception as exc:
        return _refused(name, str(exc), guard_on)
    return Check(name, OK, "every registration reaches the guard's BlockPool wrappers")


def _install_checks() -> list[Check]:
    """The guard's and vLLM's versions, the entry point, and vLLM's plugin loader."""
    version = targets.vllm_version()
    tested = "tested" if version in TESTED_VLLM else "not among the tested releases"
    release = f"{version} ({tested}: {', '.join(TESTED_VLLM)}; the checks below decide)"
    entry = [e.value for e in entry_points(group=ENTRY_POINT_GROUP) if e.name == ENTRY_POINT_NAME]
    found = entry[0] if entry else f"no {ENTRY_POINT_NAME} in {ENTRY_POINT_GROUP}"
    return [
        Check("vllm-prefix-guard", INFO, __version__),
        Check("vLLM", OK if version != "unknown" else FAIL, release),
        Check("entry point", OK if entry else FAIL, found),
        _plugin_loader_check(),
    ]


def _plugin_loader_check() -> Check:
    """vLLM still loads the entry point's group (one that stopped would serve unguarded
    whatever ``VLLM_PREFIX_GUARD`` says)."""
    try:
        import vllm.plugins as plugins
    except Exception as exc:  # reported, not raised: doctor runs without a working vLLM
        return Check("vLLM plugin loader", FAIL, f"vllm.plugins cannot be imported ({exc})")
    group = getattr(plugins, "DEFAULT_PLUGINS_GROUP", None)
    if group == ENTRY_POINT_GROUP and callable(getattr(plugins, "load_general_plugins", None)):
        return Check("vLLM plugin loader", OK, f"vLLM loads the {group} plugins")
    return Check(
        "vLLM plugin loader",
        FAIL,
        f"this vLLM does not load {ENTRY_POINT_GROUP} plugins (vllm.plugins has no "
        "load_general_plugins for that group): it would never run the guard",
    )


def _internal_checks() -> list[Check]:
    checks = []
    for what, run in targets.all_checks():
        try:
            found = run()
        except Exception as exc:
            checks.append(Check(f"internal {what}", FAIL, str(exc)))
        else:
            detail = _state_groups(found) if run is targets.check_state_groups else "present"
            checks.append(Check(f"internal {what}", OK, detail))
    return checks


def report_lines(checks: list[Check], verbose: bool = False) -> list[str]:
    """``doctor``'s text: the failures first, then every check in order (the internals
    folded into one line while all are present, unless ``verbose``), then the verdict."""
    failed = [c.render() for c in checks if c.failed]
    internals = [c for c in checks if c.name.startswith("internal ")]
    if not verbose and internals and not any(c.failed for c in internals):
        first = internals[0]
        detail = f"all {len(internals)} vLLM internals the guard touches are as it expects"
        checks = [c for c in checks if c is first or not c.name.startswith("internal ")]
        checks[checks.index(first)] = Check("internals", OK, f"{detail} (--verbose lists them)")
    return [*failed, *([""] if failed else []), *(c.render() for c in checks), verdict(checks)]


def verdict(checks: list[Check]) -> str:
    """The closing line: whether a server started from this shell starts, guarded or not."""
    failed = [c.name for c in checks if c.failed]
    if failed:
        names = ", ".join(failed[:3]) + (", ..." if len(failed) > 3 else "")
        return (
            f"verdict: {len(failed)} FAIL ({names}): a vLLM server started from this shell "
            "would not start, or not guarded; see the first lines"
        )
    on = "ON" if any(c.name == "guard" and c.detail.startswith("ON") for c in checks) else "OFF"
    return f"verdict: ok: a vLLM server started from this shell starts, the guard {on}"


def _state_groups(pool_calls: object) -> str:
    if not pool_calls:
        return "no state-group manager in this vLLM"
    return (
        "hybrid models' state groups (Mamba, GDN and other linear attention, cached per "
        "block in align mode) are guarded like attention: every pool call of vLLM's "
        f"MambaManager is one the guard follows ({', '.join(pool_calls)})"  # type: ignore[arg-type]
    )


def _activation_checks() -> tuple[list[Check], bool]:
    """``VLLM_PLUGINS`` and ``VLLM_PREFIX_GUARD``: their checks, and whether they turn the
    guard on for a server started from this shell."""
    allowed = os.environ.get("VLLM_PLUGINS")
    loaded = allowed is None or ENTRY_POINT_NAME in allowed.split(",")
    listed = f"{allowed!r}: {'includes' if loaded else 'excludes'} prefix_guard"
    listed = "unset: every plugin loads" if allowed is None else listed
    checks = [Check("VLLM_PLUGINS", OK if loaded else INFO, listed)]
    raw = os.environ.get(plugin.ENV_VAR)
    try:
        enabled = plugin.enabled_by_env()
    except GuardConfigError as exc:
        fails = Check("guard", FAIL, "a server started from this shell fails to start")
        return [*checks, Check(plugin.ENV_VAR, FAIL, str(exc)), fails], False
    checks.append(Check(plugin.ENV_VAR, OK, "unset" if raw is None else repr(raw)))
    if loaded or not enabled:
        shell = "for a vLLM server started from this shell"
        state = f"ON {shell}" if enabled else f"OFF {shell} (set {plugin.ENV_VAR}=1)"
        return [*checks, Check("guard", INFO, state)], enabled
    unloaded = (  # asked for, and vLLM would never load it: never unguarded in silence
        f"{plugin.ENV_VAR} asks for it, but VLLM_PLUGINS={allowed!r} leaves "
        f"{ENTRY_POINT_NAME} out: vLLM would not load it and would serve unguarded. "
        f"Add {ENTRY_POINT_NAME} to VLLM_PLUGINS, or unset {plugin.ENV_VAR}."
    )
    return [*checks, Check("guard", FAIL, unloaded)], False


def _refused(name: str, detail: str, guard_on: bool) -> Check:
    """What the enabled guard refuses to start on: a failure while it is on, else info."""
    if guard_on:
        return Check(name, FAIL, detail)
    return Check(name, INFO, f"with {plugin.ENV_VAR}=1 a server would refuse to start: {detail}")


def _setting_checks(guard_on: bool) -> list[Check]:
    """The settings the guard checks at start-up once it is on (``plugin.setting_checks``)."""
    checks = []
    for setting, run in plugin.setting_checks():
        try:
            found = run()
        except GuardConfigError as exc:
            checks.append(_refused(setting, str(exc), guard_on))
            continue
        if setting == stats.STATS_FILE_ENV:
            detail = "unset" if found is None else f"{found!r}: its directory is writable"
        elif os.environ.get(setting):
            detail = f"{found!r}: inherited, writable"
        else:
            detail = f"unset: the guard makes one in {found!r} (writable) at start-up"
        checks.append(Check(setting, OK, detail))
    return checks


def _self_test() -> Check:
    from vllm_prefix_guard.selftest import zombie_layout

    was_applied = plugin.is_applied()
    plugin.undo()
    stock = zombie_layout()
    plugin.apply()
    guarded = zombie_layout()
    if not was_applied:
        plugin.undo()
    found = f"entries over KV no step wrote, summed over steps: stock {stock}, guarded {guarded}"
    found += "" if stock else " (this vLLM build does not show the stock failure)"
    return Check("self-test (priority zombie layout)", FAIL if guarded else OK, found)
