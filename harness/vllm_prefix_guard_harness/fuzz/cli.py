"""``vllm-prefix-guard-harness fuzz``: is *this* vLLM build exposed, and does the guard hold on it?

Runs the differential fuzzer against the installed vLLM (stock, guard, and PR #43569's
rollback scope on the same seeds), prints the per-configuration table and checks, and
for every guarded run that read bad KV a shrunk, paste-able reproducer. Exit status:
0 when every check passed, 1 when any check failed (the closing summary lists each),
2 when the guard cannot apply here or the arguments are wrong.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any

from vllm_prefix_guard_harness.fuzz.configs import (
    ALL_CONFIGS,
    CONFIGS,
    SOAK_ONLY,
    FuzzConfig,
    runnable,
)
from vllm_prefix_guard_harness.fuzz.hash_seed import (
    current_hash_seed,
    reexec_with_fixed_hash_seed,
)

EXIT_OK, EXIT_CHECK_FAILED, EXIT_UNSUPPORTED = 0, 1, 2


def build_parser() -> argparse.ArgumentParser:
    """The ``fuzz`` command's own parser."""
    parser = argparse.ArgumentParser(
        prog="vllm-prefix-guard-harness fuzz",
        description="Randomised differential runs against the installed vLLM: stock, the guard "
        "and PR #43569's rollback scope on the same seeds, checked by a fake worker that knows "
        "what every KV slot holds. Exit status: 0 every check passed, 1 a check failed, "
        "2 the guard cannot apply here.",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        help="time budget: seeds 0, 1, ... round-robin over configurations (default 60 "
        "unless --seeds is given)",
    )
    parser.add_argument("--seeds", type=int, help="seeds per configuration (0..N-1)")
    parser.add_argument(
        "--config",
        action="append",
        choices=sorted(ALL_CONFIGS),
        metavar="NAME",
        help="configuration to run (repeatable; default: all but the soak-only ones; see --list)",
    )
    parser.add_argument(
        "--modes",
        default="stock,guard,pr43569",
        help="comma-separated subset of stock,guard,pr43569 (default: all three), plus "
        "ideal: the guard with every rollback filtered by the shadow KV (audit)",
    )
    parser.add_argument("--horizon", type=int, help="arrival iterations per seed")
    parser.add_argument(
        "--shrink-seconds",
        type=float,
        default=30.0,
        help="time to shrink each reproducer (0: print none)",
    )
    parser.add_argument(
        "--shrink-all",
        action="store_true",
        help="shrink the first failure of stock and pr43569 too, not only the guard's",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--list", action="store_true", help="list configurations and exit")
    return parser


def main(argv: list[str], reexec: bool = False) -> int:
    """Parse ``argv`` and run; with ``reexec`` (a real command line), first make sure
    the process runs under a fixed hash seed (see ``hash_seed``)."""
    args = build_parser().parse_args(argv)
    args.argv = list(argv)
    if reexec and not args.list:
        reexec_with_fixed_hash_seed()
    return run(args)


def run(args: argparse.Namespace) -> int:
    """The ``fuzz`` command; returns the exit status."""
    if args.list:
        for config in ALL_CONFIGS.values():
            mark = " [targeted]" if config.targeted else ""
            mark += " [soak only]" if config.name in SOAK_ONLY else ""
            print(f"{config.name}{mark}: {config.description}")
        return EXIT_OK
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    quiet_vllm()
    from vllm_prefix_guard import plugin, targets
    from vllm_prefix_guard.errors import GuardUnsupportedError
    from vllm_prefix_guard_harness.fuzz.differential import run_matrix
    from vllm_prefix_guard_harness.fuzz.report import (
        checks_text,
        markdown_table,
        summary_table,
        to_json,
    )
    from vllm_prefix_guard_harness.fuzz.runner import MODES, ORACLE_MODES

    unknown = set(modes) - set(MODES + ORACLE_MODES)
    if unknown:
        bad = ", ".join(sorted(unknown))
        print(f"unknown mode(s) {bad}; use {', '.join(MODES + ORACLE_MODES)}", file=sys.stderr)
        return EXIT_UNSUPPORTED
    environment = _environment(plugin, targets)
    if "guard" in modes or "pr43569" in modes:
        try:
            _probe_guard(plugin)
        except GuardUnsupportedError as exc:
            print(f"the guard cannot apply to this vLLM: {exc}", file=sys.stderr)
            return EXIT_UNSUPPORTED
    configs = [ALL_CONFIGS[name] for name in args.config] if args.config else list(CONFIGS.values())
    configs, skipped = runnable(configs)
    for name, reason in skipped.items():
        print(f"{name}: not run: {reason}", file=sys.stderr)
    if not configs:
        return EXIT_OK
    seconds = args.seconds if args.seconds is not None or args.seeds else 60.0
    seeds = range(args.seeds) if args.seeds else None
    results = run_matrix(
        configs,
        seeds,
        modes=modes,
        horizon=args.horizon,
        seconds=seconds,
        progress=None if args.json else _progress,
    )
    reproducers = _reproducers(results, args) if args.shrink_seconds > 0 else {}
    failed = [(r.config.name, c) for r in results for c in r.checks() if not c.ok]
    if args.json:
        print(json.dumps(to_json(results, environment, reproducers), indent=2))
    else:
        print()
        print(summary_table(results))
        print()
        print(markdown_table(results))
        print()
        print(checks_text(results))
        for name, by_mode in reproducers.items():
            for mode, source in by_mode.items():
                print(f"\n# Minimal reproducer: {name}, bad KV read in mode {mode!r}\n{source}")
        print()
        print(_summary(results, environment, failed, args.argv))
    return EXIT_CHECK_FAILED if failed else EXIT_OK


def quiet_vllm() -> None:
    """Keep the report readable: vLLM logs every scheduler it builds (warnings) and every
    KV load the fuzzer makes fail (errors). Call before the first fuzz run."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "CRITICAL")
    import vllm.logger  # noqa: F401  (configures the "vllm" logger; then override it)

    logging.getLogger("vllm").setLevel(logging.CRITICAL)


def _environment(plugin: Any, targets: Any) -> dict[str, Any]:
    native = targets.native_fix()
    return {
        "vllm_version": targets.vllm_version(),
        "upstream_fix": native.describe() if native.complete else None,
        "guard_applied_at_start": plugin.is_applied(),
        "python_hash_seed": current_hash_seed(),
    }


def _probe_guard(plugin: Any) -> None:
    """Fail before fuzzing if the guard's targets are missing (apply checks them all)."""
    was_applied = plugin.is_applied()
    plugin.apply()
    if not was_applied:
        plugin.undo()


def _progress(config: FuzzConfig, seed: int, runs: dict[str, Any]) -> None:
    parts = " ".join(f"{mode}={run.violations}" for mode, run in runs.items())
    steps = max(run.steps for run in runs.values())
    print(f"{config.name} seed {seed}: {steps} steps, bad reads {parts}", file=sys.stderr)


def _reproducers(results: list[Any], args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """Shrink the first failing seed of the guard (of every mode with ``--shrink-all``)."""
    from vllm_prefix_guard_harness.fuzz.shrink import shrink

    wanted = ("guard", "pr43569", "stock") if args.shrink_all else ("guard",)
    out: dict[str, dict[str, str]] = {}
    for result in results:
        for mode in wanted:
            failing = result.violating_seeds.get(mode)
            if not failing:
                continue
            if not args.json:
                name = result.config.name
                print(f"shrinking {name} seed {failing[0]} ({mode})...", file=sys.stderr)
            workload = result.config.workload(failing[0], args.horizon)
            small = shrink(workload, mode, seconds=args.shrink_seconds)
            out.setdefault(result.config.name, {})[mode] = small.to_python()
    return out


def _bad_in(results: list[Any], mode: str) -> list[str]:
    return [r.config.name for r in results if mode in r.totals and r.totals[mode].violations]


def _summary(
    results: list[Any], environment: dict[str, Any], failed: list[tuple[str, Any]], argv: list[str]
) -> str:
    """The closing lines: exposure, the guard's verdict, every failed check, how to re-run."""
    exposed = _bad_in(results, "stock")
    guard_bad = _bad_in(results, "guard")
    lines = [
        f"vLLM {environment['vllm_version']}, PYTHONHASHSEED={environment['python_hash_seed']}:"
    ]
    if "stock" in results[0].totals:
        lines.append(
            f"  stock read bad KV in {len(exposed)} of {len(results)} configurations"
            + (f" ({', '.join(exposed)})" if exposed else "")
        )
    if "guard" in results[0].totals:
        lines.append(
            "  guard: no bad KV read in any configuration"
            if not guard_bad
            else f"  guard READ BAD KV in: {', '.join(guard_bad)}"
        )
    if failed:
        lines.append(f"  {len(failed)} check(s) FAILED:")
        lines += [f"    {name}: {check.name}: {check.detail}" for name, check in failed]
    else:
        lines.append("  every check passed")
    rerun = " ".join(["vllm-prefix-guard", "fuzz", *argv])
    lines.append(f"  re-run: PYTHONHASHSEED={environment['python_hash_seed']} {rerun}")
    return "\n".join(lines)
