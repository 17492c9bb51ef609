#!/usr/bin/env python3
"""KV events per fuzz configuration: what each consumer model gets wrong, and how often a
``BlockStored`` reaches a consumer before the guard rolls its entry back.

Every CI configuration on seeds 0-2, stock and guard (``fuzz.runner``: after every step a
set consumer and a counting consumer replayed from the published events are compared with
the pool). For the guard it also counts the keys announced stored in a batch already
published and then removed by a rollback (a failed load reported later, a dropped step): the
announcements that waiting for each step's commit before publishing ``BlockStored`` would
spare routers, at the price of every announcement coming one step later. Prints a markdown
table (docs/operations.md quotes it).

Usage (the Python of a vLLM venv)::

    PYTHONHASHSEED=0 python benchmarks/kv_events_report.py [--seeds 3]
"""

from __future__ import annotations

import argparse

from vllm_prefix_guard.targets import vllm_version
from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS, runnable
from vllm_prefix_guard_harness.fuzz.differential import run_matrix


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    quiet_vllm()
    configs, _ = runnable(list(CONFIGS.values()))
    print(f"vLLM {vllm_version()}, seeds 0-{args.seeds - 1} of each CI configuration.\n")
    print(
        "| configuration | stock: set consumer keys wrong (steps) | stock: counting consumer "
        "| guard: set | guard: counting | guard: keys announced | announced, then rolled back |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    totals = [0, 0]
    for result in run_matrix(configs, range(args.seeds), modes=("stock", "guard")):
        stock, guard = result.totals["stock"], result.totals["guard"]
        rolled, stored = guard.kv_event_rolled_back_after_publish, guard.kv_event_keys_stored
        totals[0] += rolled
        totals[1] += stored
        share = f"{rolled} ({100 * rolled / stored:.2f}%)" if stored else "-"
        print(
            f"| {result.config.name} "
            f"| {stock.kv_event_keys_missing + stock.kv_event_keys_extra} "
            f"({stock.kv_event_inconsistent_steps}) "
            f"| {stock.kv_event_counted_keys_missing + stock.kv_event_counted_keys_extra} "
            f"| {guard.kv_event_keys_missing + guard.kv_event_keys_extra} "
            f"| {guard.kv_event_counted_keys_missing + guard.kv_event_counted_keys_extra} "
            f"| {stored} | {share} |"
        )
    print(
        f"\nIn all: {totals[0]} of {totals[1]} keys the guard announced stored were rolled back "
        f"after the announcement was published ({100 * totals[0] / max(totals[1], 1):.2f}%)."
    )


if __name__ == "__main__":
    main()
