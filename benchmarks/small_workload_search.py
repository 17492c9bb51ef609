"""Random search over small workloads with KV loads that fail on some blocks only.

The fuzz configurations run long workloads on a 16-token block; this samples many tiny
ones instead (block size 4, a pool of 8-14 blocks, 3-4 requests from two prompt
families, async scheduling with two steps in flight, policy ``recompute``), where one
failed block sits next to blocks that loaded fine, and aborts land while a step is in
flight. Each workload runs guarded with the rollback audit; the search reports every
workload where the guard reads bad KV, rolls back a valid entry or commits a wrong one,
as a paste-able ``Workload``. It found the shape pinned by
``tests/regression/test_kv_load_failure.py::test_partial_failed_loads_read_no_bad_kv``.

Usage (the Python of a venv with vLLM):
    PYTHONHASHSEED=0 python benchmarks/small_workload_search.py --seed 3 --seconds 300
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.cli import quiet_vllm
from vllm_prefix_guard_harness.fuzz.runner import run_workload
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Event, Workload


def small_workload(rng: random.Random) -> Workload:
    spec = SchedulerSpec(
        block_size=4,
        num_blocks=rng.randint(8, 14),
        max_num_seqs=4,
        max_num_batched_tokens=rng.choice([8, 12, 16]),
        max_model_len=64,
        long_prefill_token_threshold=rng.choice([0, 4, 8]),
        policy=rng.choice(["fcfs", "priority"]),
        async_scheduling=True,
        kv_load_failure_policy="recompute",
    )
    families = [(100, 4 * rng.randint(1, 3)), (200, 4 * rng.randint(1, 3))]
    events: list[Event] = []
    for index in range(rng.randint(3, 4)):
        family = rng.choice(families)
        external = 4 * rng.randint(0, family[1] // 4)
        fails = external > 0 and rng.random() < 0.6
        failed_blocks: tuple[int, ...] = ()
        if fails and external >= 8 and rng.random() < 0.5:
            num_blocks = external // 4
            failed_blocks = tuple(
                sorted(rng.sample(range(num_blocks), rng.randint(1, num_blocks - 1)))
            )
        prompt = (family, (1000 + index, rng.randint(1, 6)))
        events.append(
            Arrive(
                rng.randint(0, 4),
                f"r{index}",
                prompt,
                rng.randint(1, 3),
                rng.randint(0, 1),
                external,
                fails,
                failed_blocks,
            )
        )
        if rng.random() < 0.3:
            events.append(Abort(rng.randint(0, 5), f"r{index}"))
    events.sort(key=lambda event: event.step)
    return Workload(spec, 2, tuple(events)).with_consistent_events()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seconds", type=float, default=300.0)
    args = parser.parse_args(argv)
    quiet_vllm()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.seconds
    tried = found = 0
    while time.monotonic() < deadline:
        workload = small_workload(rng)
        tried += 1
        run = run_workload(workload, "guard", audit=True)
        audit = run.audit
        assert audit is not None
        if run.violations or audit.valid_rolled_back or audit.invalid_committed:
            found += 1
            print(
                f"guard: {run.violations} bad reads, {audit.valid_rolled_back} valid entries "
                f"rolled back, {audit.invalid_committed} committed on wrong KV",
                flush=True,
            )
            print(workload.to_python(f"FOUND_{found}"), flush=True)
    print(f"{tried} workloads (seed {args.seed}), {found} where the guard failed a check")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
