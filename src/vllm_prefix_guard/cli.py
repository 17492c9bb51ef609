"""``vllm-prefix-guard``: operator commands.

vllm-prefix-guard doctor [--self-test] [--json]
    Is the plugin installed and allowed, is VLLM_PREFIX_GUARD valid, does the
    installed vLLM have every internal the guard needs, and (with --self-test) does
    the guard remove the known stock failure on this very build.
vllm-prefix-guard fuzz ...
    Randomised shadow-KV differential run against the installed vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib.metadata import entry_points
from typing import Any

from vllm_prefix_guard.fuzz.cli import add_parser as add_fuzz_parser

ENTRY_POINT_GROUP = "vllm.general_plugins"
ENTRY_POINT_NAME = "prefix_guard"


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"check": name, "ok": ok, "detail": detail}


def doctor_checks(self_test: bool) -> list[dict[str, Any]]:
    """Every check ``doctor`` reports, in order; each is ``{check, ok, detail}``."""
    from vllm_prefix_guard import plugin, targets
    from vllm_prefix_guard.pool import GuardUnsupportedError

    checks = [_check("vLLM importable", True, targets.vllm_version())]
    found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == ENTRY_POINT_NAME]
    checks.append(
        _check(
            "entry point registered",
            bool(found),
            found[0].value if found else f"no {ENTRY_POINT_NAME} in {ENTRY_POINT_GROUP}",
        )
    )
    allowed = os.environ.get("VLLM_PLUGINS")
    allowed_ok = allowed is None or ENTRY_POINT_NAME in allowed.split(",")
    checks.append(
        _check("VLLM_PLUGINS allows it", allowed_ok, "unset" if allowed is None else allowed)
    )
    try:
        enabled = plugin.enabled_by_env()
        checks.append(_check(f"{plugin.ENV_VAR} valid", True, "on" if enabled else "off"))
    except plugin.GuardConfigError as exc:
        checks.append(_check(f"{plugin.ENV_VAR} valid", False, str(exc)))
    upstream = targets.upstream_fix()
    checks.append(
        _check("upstream fix absent", True, "none" if upstream is None else f"present: {upstream}")
    )
    for target in targets.SCHEDULER_TARGETS + targets.POOL_TARGETS:
        try:
            targets.check(target)
            checks.append(_check(f"target {target.qualname}", True, "ok"))
        except GuardUnsupportedError as exc:
            checks.append(_check(f"target {target.qualname}", False, str(exc)))
    try:
        targets.check_coordinator()
        checks.append(_check("target KVCacheCoordinator.block_pool", True, "ok"))
    except GuardUnsupportedError as exc:
        checks.append(_check("target KVCacheCoordinator.block_pool", False, str(exc)))
    if self_test and all(c["ok"] for c in checks):
        checks.append(_self_test())
    return checks


def _self_test() -> dict[str, Any]:
    """Run the notes' deterministic zombie layout on stock and guarded schedulers."""
    from vllm_prefix_guard import plugin
    from vllm_prefix_guard.testing.selftest import zombie_layout_violations

    was_applied = plugin.is_applied()
    plugin.undo()
    stock = zombie_layout_violations()
    plugin.apply()
    guarded = zombie_layout_violations()
    if not was_applied:
        plugin.undo()
    ok = guarded == 0
    return _check(
        "self-test (priority zombie layout)",
        ok,
        f"stock wrong reads={stock}, guarded wrong reads={guarded}"
        + ("" if stock else " (this vLLM build does not show the stock failure)"),
    )


def cmd_doctor(args: argparse.Namespace) -> int:
    checks = doctor_checks(args.self_test)
    if args.json:
        print(json.dumps(checks, indent=2))
    else:
        for c in checks:
            print(f"[{'ok' if c['ok'] else 'FAIL':>4}] {c['check']}: {c['detail']}")
    return 0 if all(c["ok"] for c in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-prefix-guard", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="check the installation against the installed vLLM")
    doctor.add_argument("--self-test", action="store_true", help="also run stock vs guarded")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=cmd_doctor)
    add_fuzz_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = build_parser().parse_args(argv)
    if argv is None and args.command == "fuzz" and not args.list:
        from vllm_prefix_guard.fuzz.hash_seed import reexec_with_fixed_hash_seed

        reexec_with_fixed_hash_seed()
    result: int = args.func(args)
    return result


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
