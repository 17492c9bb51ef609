"""What the not-computed rule changes: nothing with vLLM's runners, everything with a
worker that drops aborted requests.

The rule (``UncommittedPrefixCache.gather_not_computed``, called by
``SchedulerGuard.not_computed``) rolls back the entries of a request a step's
``ModelRunnerOutput`` leaves out. This runs every fuzz configuration on seeds
``0..N-1`` guarded twice, with the rule and with it switched off (the guard as it was
before: a step's record committed whole), and

- for every configuration whose worker lists every request (all but the ``drop_aborted``
  ones): checks that every figure of the two runs is identical (hits, preemptions,
  computed tokens, steps, every rollback counter, the decisions digest, the rollback
  audit), as they must be if the rule costs no valid hit;
- for the ``drop_aborted`` configurations: prints bad reads of stock, of the guard
  without the rule and of the guard.

Exit status 1 if a figure differs or the guard reads bad KV. Usage (a venv with vLLM):
    PYTHONHASHSEED=0 python benchmarks/not_computed_rule.py --seeds 5
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_prefix_guard.diagnostics.fuzz.cli import quiet_vllm
from vllm_prefix_guard.diagnostics.fuzz.configs import CONFIGS
from vllm_prefix_guard.diagnostics.fuzz.runner import RunResult, run_workload
from vllm_prefix_guard.scheduler_guard import SchedulerGuard

#: Figures that depend on the clock or on the run's identity, not on its decisions.
NOT_COMPARED = {"seconds"}


@contextmanager
def rule_off() -> Iterator[None]:
    """The guard without the rule: the output's list of requests is not consulted."""
    rule = SchedulerGuard.not_computed
    SchedulerGuard.not_computed = lambda self, output, model_runner_output: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        SchedulerGuard.not_computed = rule  # type: ignore[method-assign]


def figures(result: RunResult) -> dict[str, Any]:
    out = dataclasses.asdict(result)
    for name in NOT_COMPARED:
        out.pop(name, None)
    return out


def bad_reads(result: RunResult) -> int:
    return result.never_written + result.wrong_content


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 per configuration")
    args = parser.parse_args(argv)
    quiet_vllm()
    failed = False
    for name, config in CONFIGS.items():
        reason = config.unavailable()
        if reason is not None:
            print(f"{name}: not run: {reason}")
            continue
        if config.drop_aborted:
            totals = {"stock": 0, "guard without the rule": 0, "guard": 0}
            for seed in range(args.seeds):
                workload = config.workload(seed)
                totals["stock"] += bad_reads(run_workload(workload, "stock"))
                with rule_off():
                    totals["guard without the rule"] += bad_reads(run_workload(workload, "guard"))
                totals["guard"] += bad_reads(run_workload(workload, "guard"))
            failed |= totals["guard"] > 0
            print(
                f"{name}: bad reads, seeds 0-{args.seeds - 1}: "
                + ", ".join(f"{mode} {count:,}" for mode, count in totals.items())
            )
            continue
        differing: set[str] = set()
        for seed in range(args.seeds):
            workload = config.workload(seed)
            with_rule = run_workload(workload, "guard", audit=True)
            with rule_off():
                without = run_workload(workload, "guard", audit=True)
            a, b = figures(with_rule), figures(without)
            differing |= {key for key in a if a[key] != b[key]}
        failed |= bool(differing)
        verdict = f"DIFFER in {', '.join(sorted(differing))}" if differing else "identical"
        print(f"{name}: with and without the rule, seeds 0-{args.seeds - 1}: {verdict}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
