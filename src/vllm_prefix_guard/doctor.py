"""``vllm-prefix-guard doctor``: will the guard be on, and can it apply to the installed vLLM?

Each check is a :class:`Check` (``ok``, ``FAIL``, ``skip`` or ``info``). The checks run the
same code the plugin runs at start-up: the entry point, ``VLLM_PREFIX_GUARD``, the other
settings (:func:`vllm_prefix_guard.plugin.setting_checks`: the stats file's directory, the
run directory the guard shares between a server's processes), vLLM's own fix, every internal
in :data:`vllm_prefix_guard.targets.INTERNALS`, and the pool kvcached swaps in. Wherever a
server started from this shell would refuse to start, a check fails (and ``doctor`` exits
1); a setting only the enabled guard reads is reported, not failed, while the guard is off.
``--self-test`` then runs the known failure on stock and guarded schedulers of this very
vLLM build (``selftest``, imported only then).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points

from vllm_prefix_guard import __version__, kvcached_support, plugin, stats, targets
from vllm_prefix_guard.errors import GuardConfigError
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
    checks += activation
    checks += _setting_checks(guard_on)
    checks.append(_upstream_check())
    kvcached = kvcached_support.status()
    refused = kvcached.variant == "legacy" and kvcached.enabled and not kvcached.refuses_vllm
    detail = kvcached.describe()
    check = _refused("kvcached", detail, guard_on) if refused else Check("kvcached", INFO, detail)
    checks.append(check)
    checks.append(_patch_table())
    internals = _internal_checks()
    checks += internals
    internals_ok = not any(c.failed for c in internals)
    if internals_ok and kvcached.active and not refused and kvcached.pool_class is not None:
        checks.append(_kvcached_pool_check(kvcached.pool_class, guard_on))
    if self_test:
        failed = sum(c.failed for c in checks)
        if failed:
            checks.append(Check("self-test", SKIP, f"not run: {failed} check(s) above failed"))
        else:
            checks.append(_self_test())
    return checks


def _install_checks() -> list[Check]:
    """The guard's and vLLM's versions, the entry point, and vLLM's plugin loader."""
    version = targets.vllm_version()
    tested = version in TESTED_VLLM
    entry = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    return [
        Check("vllm-prefix-guard", INFO, __version__),
        Check(
            "vLLM",
            OK if version != "unknown" else FAIL,
            f"{version} ({'tested' if tested else 'not among the tested releases'}: "
            f"{', '.join(TESTED_VLLM)}; the checks below decide)",
        ),
        Check(
            "entry point",
            OK if entry else FAIL,
            entry[0].value if entry else f"no {ENTRY_POINT_NAME} in {ENTRY_POINT_GROUP}",
        ),
        _plugin_loader_check(),
    ]


def _upstream_check() -> Check:
    """Whether this vLLM ships its own fix: whole (the guard stays out), in part (it
    refuses to start), or not at all."""
    native = targets.native_fix()
    if native.complete:
        return Check("upstream fix", INFO, f"{native.describe()}: the guard stays out")
    if native.partial:
        return Check(
            "upstream fix",
            FAIL,
            f"partly there ({native.describe()}): the guard refuses to start beside it",
        )
    return Check("upstream fix", INFO, "none in this vLLM: the guard patches it")


def _patch_table() -> Check:
    """What the guard patches, from the patch table (each row's reasons are in
    docs/design.md's registry)."""
    from vllm_prefix_guard.patches import PATCHES

    owners = sorted({patch.owner for patch in PATCHES})
    return Check(
        "patch table",
        INFO,
        f"{len(PATCHES)} patches on vLLM's {', '.join(owners)}, each with its why and its "
        "removal plan (docs/design.md, patch registry); every target is checked below",
    )


def _internal_checks() -> list[Check]:
    """The start-up checks (``targets.all_checks``), one by one, failures included."""
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
    failed = [c for c in checks if c.failed]
    lines = [c.render() for c in failed]
    if failed:
        lines.append("")
    internals = [c for c in checks if c.name.startswith("internal ")]
    folded = not verbose and internals and not any(c.failed for c in internals)
    for check in checks:
        if folded and check.name.startswith("internal "):
            if check is internals[0]:
                lines.append(
                    Check(
                        "internals",
                        OK,
                        f"all {len(internals)} vLLM internals the guard touches are as it "
                        "expects (--verbose lists them)",
                    ).render()
                )
            continue
        lines.append(check.render())
    lines.append(verdict(checks))
    return lines


def verdict(checks: list[Check]) -> str:
    """The closing line: whether a server started from this shell starts, guarded or not."""
    failed = [c for c in checks if c.failed]
    if failed:
        names = ", ".join(c.name for c in failed[:3]) + (", ..." if len(failed) > 3 else "")
        return (
            f"verdict: {len(failed)} FAIL ({names}): a vLLM server started from this shell "
            "would not start, or not guarded; see the first lines"
        )
    guard = next((c for c in checks if c.name == "guard"), None)
    state = "ON" if guard is not None and guard.detail.startswith("ON") else "OFF"
    return f"verdict: ok: a vLLM server started from this shell starts, the guard {state}"


def _state_groups(pool_calls: object) -> str:
    """What ``doctor`` says of hybrid models' state groups."""
    if not pool_calls:
        return "no state-group manager in this vLLM"
    return (
        "hybrid models' state groups (Mamba, GDN and other linear attention, cached per "
        "block in align mode) are guarded like attention: every pool call of vLLM's "
        f"MambaManager is one the guard follows ({', '.join(pool_calls)})"  # type: ignore[arg-type]
    )


def _plugin_loader_check() -> Check:
    """vLLM still loads general plugins from the group the guard's entry point is in (a
    vLLM that stopped would serve unguarded whatever ``VLLM_PREFIX_GUARD`` says)."""
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


def _activation_checks() -> tuple[list[Check], bool]:
    """``VLLM_PLUGINS`` and ``VLLM_PREFIX_GUARD``, and what they add up to: the checks, and
    whether the guard is on for a server started from this shell."""
    allowed = os.environ.get("VLLM_PLUGINS")
    loaded = allowed is None or ENTRY_POINT_NAME in allowed.split(",")
    checks = [
        Check(
            "VLLM_PLUGINS",
            OK if loaded else INFO,
            "unset: every plugin loads"
            if allowed is None
            else f"{allowed!r}: "
            + ("includes prefix_guard" if loaded else "excludes prefix_guard"),
        )
    ]
    raw = os.environ.get(plugin.ENV_VAR)
    try:
        enabled = plugin.enabled_by_env()
    except GuardConfigError as exc:
        checks.append(Check(plugin.ENV_VAR, FAIL, str(exc)))
        checks.append(Check("guard", FAIL, "a server started from this shell fails to start"))
        return checks, False
    checks.append(Check(plugin.ENV_VAR, OK, "unset" if raw is None else repr(raw)))
    if enabled and loaded:
        checks.append(Check("guard", INFO, "ON for a vLLM server started from this shell"))
    elif not enabled:
        verdict = f"OFF for a vLLM server started from this shell (set {plugin.ENV_VAR}=1)"
        checks.append(Check("guard", INFO, verdict))
    else:  # asked for, and vLLM would never load it: never unguarded in silence
        checks.append(
            Check(
                "guard",
                FAIL,
                f"{plugin.ENV_VAR} asks for it, but VLLM_PLUGINS={allowed!r} leaves "
                f"{ENTRY_POINT_NAME} out: vLLM would not load it and would serve unguarded. "
                f"Add {ENTRY_POINT_NAME} to VLLM_PLUGINS, or unset {plugin.ENV_VAR}.",
            )
        )
    return checks, enabled and loaded


_WHEN_ON = f"with {plugin.ENV_VAR}=1 a server would refuse to start: "


def _refused(name: str, detail: str, guard_on: bool) -> Check:
    """What the enabled guard refuses to start on: a failure while it is on, else info."""
    return Check(name, FAIL, detail) if guard_on else Check(name, INFO, _WHEN_ON + detail)


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


def _kvcached_pool_check(pool_class: type, guard_on: bool) -> Check:
    """What the guard checks when it attaches to the pool kvcached swaps in."""
    from vllm_prefix_guard import pool

    name = f"kvcached pool {pool_class.__module__}.{pool_class.__qualname__}"
    try:
        pool.check_pool(pool_class)
    except Exception as exc:
        return _refused(name, str(exc), guard_on)
    return Check(name, OK, "every registration reaches the guard's BlockPool wrappers")


def _self_test() -> Check:
    """Run the notes' priority-preemption layout on stock and guarded schedulers."""
    from vllm_prefix_guard.selftest import zombie_layout

    was_applied = plugin.is_applied()
    plugin.undo()
    stock = zombie_layout()
    plugin.apply()
    guarded = zombie_layout()
    if not was_applied:
        plugin.undo()
    return Check(
        "self-test (priority zombie layout)",
        OK if guarded == 0 else FAIL,
        f"entries over KV no step wrote, summed over steps: stock {stock}, guarded {guarded}"
        + ("" if stock else " (this vLLM build does not show the stock failure)"),
    )
