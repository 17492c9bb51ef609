"""Soak: at least ``--steps`` scheduler steps per configuration and mode, then a report.

    python -m vllm_prefix_guard_harness.fuzz.soak --steps 100000 [--config NAME ...] [--jobs N]
                                          [--out FILE.md]

Seeds 0, 1, ... run (every mode on each) until each mode of a configuration has taken
``--steps`` scheduler steps. Each seed's workload is ``--horizon-factor`` times the CI
horizon: long enough to reach steady state, short enough that a run's shadow state
stays small. Prints (and writes to ``--out``) the differential table, a timing table
and the checks; exits 1 if a check fails (the guard read bad KV, stock was not exposed
in a targeted configuration, or a hit/preemption comparison is not accounted for).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm
from vllm_prefix_guard_harness.fuzz.configs import ALL_CONFIGS, FuzzConfig, runnable
from vllm_prefix_guard_harness.fuzz.differential import ConfigResult, run_seed
from vllm_prefix_guard_harness.fuzz.hash_seed import (
    current_hash_seed,
    reexec_with_fixed_hash_seed,
)
from vllm_prefix_guard_harness.fuzz.runner import MODES
from vllm_prefix_guard_harness.records import portable_command


def soak_config(
    config: FuzzConfig, steps: int, horizon_factor: int, modes: tuple[str, ...]
) -> ConfigResult:
    """Seeds until every mode of ``config`` has run ``steps`` scheduler steps."""
    result = ConfigResult(config, modes)
    horizon = config.horizon * horizon_factor
    seed = 0
    while min(result.totals[m].steps for m in modes) < steps:
        result.add(seed, run_seed(config, seed, modes, horizon))
        seed += 1
    return result


def _soak_one(
    config: FuzzConfig, steps: int, horizon_factor: int, modes: tuple[str, ...]
) -> ConfigResult:
    """One configuration, in a worker process (vLLM is imported once per worker)."""
    quiet_vllm()
    started = time.monotonic()
    result = soak_config(config, steps, horizon_factor, modes)
    print(f"{config.name}: {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return result


def timing_table(results: list[ConfigResult]) -> str:
    modes = results[0].modes
    header = ["configuration", "seeds", *(f"{m} steps / s / us per step" for m in modes)]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for result in results:
        cells = [result.config.name, str(len(result.seeds))]
        for mode in modes:
            run = result.totals[mode]
            per_step = 1e6 * run.seconds / run.steps if run.steps else 0.0
            cells.append(f"{run.steps} / {run.seconds:.0f} / {per_step:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--config", action="append", choices=sorted(ALL_CONFIGS), metavar="NAME")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--horizon-factor", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=1, help="configurations run in parallel")
    parser.add_argument("--out", help="also write the markdown report here")
    args = parser.parse_args(argv)
    if argv is None:
        reexec_with_fixed_hash_seed()
    quiet_vllm()
    from vllm_prefix_guard import targets
    from vllm_prefix_guard_harness.fuzz.report import checks_text, markdown_table, summary_table

    modes = tuple(m.strip() for m in args.modes.split(","))
    configs = [ALL_CONFIGS[n] for n in args.config] if args.config else list(ALL_CONFIGS.values())
    configs, skipped = runnable(configs)
    if not configs:
        for name, reason in skipped.items():
            print(f"{name}: not run: {reason}")
        return 0
    started = time.monotonic()
    if args.jobs > 1:
        # spawn: a forked child would inherit the parent's torch/OpenMP state.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
            futures = [
                pool.submit(_soak_one, c, args.steps, args.horizon_factor, modes) for c in configs
            ]
            results = [f.result() for f in futures]
    else:
        results = [_soak_one(c, args.steps, args.horizon_factor, modes) for c in configs]
    given = argv if argv is not None else sys.argv[1:]
    command = portable_command(["python", "-m", "vllm_prefix_guard_harness.fuzz.soak", *given])
    report = "\n\n".join(
        [
            f"Soak: vLLM {targets.vllm_version()}, Python {platform.python_version()} "
            f"(PYTHONHASHSEED={current_hash_seed()}), "
            f"{os.cpu_count()} CPUs, {args.jobs} job(s), "
            f"{time.monotonic() - started:.0f} s in total.\n"
            f"Command: `{command.strip()}`"
            + "".join(f"\n\nNot run: {name}: {reason}." for name, reason in skipped.items()),
            summary_table(results),
            markdown_table(results),
            timing_table(results),
            "```\n" + checks_text(results) + "\n```",
        ]
    )
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as fh:
            fh.write(report + "\n")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
