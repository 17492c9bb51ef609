"""Scheduler overhead of the guard: per-step ``schedule()`` + ``update_from_output()`` time.

Runs vLLM's real ``Scheduler`` (``AsyncScheduler`` for async cells) in steady state on the
project's harness (``vllm_prefix_guard_harness``: the scheduler factory, the
shadow-KV worker and the ``EngineCore``-like driver the tests and the fuzzer use) and
compares three columns side by side, in one process:

``stock``
    vLLM as installed: its scheduler is built, and always stepped, with the guard undone.
``guard``
    this project: built and stepped with the guard applied.
``pr43569``
    the guard's machinery with upstream PR #43569's rollback rule: on preemption, drop
    the victim's registrations from *every* in-flight step, not only the open one.

Why it is built this way:

- The guard patches class attributes, so which column runs is decided by
  ``plugin.apply()``/``plugin.undo()``, set before each column's turn (220 us, untimed).
  A scheduler built before ``apply()`` would go through the wrappers without a guard,
  which is neither column; here each column's scheduler only ever runs in its own mode.
- The three schedulers live side by side and take turns in *segments* of a few steps
  (``stock guard pr43569``, the order rotated every segment), each replaying the same
  seeded traffic. On a shared, noisy VM a burst of foreign load then hits neighbouring
  segments of every column alike; the guard/stock ratio is taken per segment pair and
  the median of those ratios is the headline number.
- Only the two scheduler calls are timed (``perf_counter_ns``, and thread CPU time
  beside it); the worker, request creation and bookkeeping sit outside the timed
  region (:class:`TimedDriver`). The cyclic GC is collected, frozen and disabled for the
  whole cell, so a collection never lands on one column.
- Under FCFS the guard changes no decision of vLLM's, so every column follows the same
  trajectory (checked with the driver's digest of each step's shape) and step ``i`` of
  one column does the same work as step ``i`` of another. Under PRIORITY stock may serve
  *zombie* blocks (registered, then their writer preempted in the same ``schedule()``);
  the shadow-KV worker knows what every block holds and counts hits on wrong content
  (its ``invalid`` hit tokens), which the guard turns into misses, so trajectories part
  there.

Usage (from the repository root, in a venv with vLLM and this project installed)::

    python benchmarks/scheduler_bench.py --out benchmarks/results/scheduler.json
    python benchmarks/scheduler_bench.py --quick                  # smoke run, ~2 minutes
    python benchmarks/scheduler_bench.py --cells 256-fcfs-pressure-sync --columns stock,stock#2
    python benchmarks/scheduler_bench.py --cells 256-fcfs-pressure-sync --profile guard

Instruction counts of the same steps under callgrind are ``instructions.py``'s.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import operator
import os
import pstats
import random
import statistics
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_io import environment, write_document
from vllm_prefix_guard_harness.factory import VOCAB_SIZE, SchedulerSpec
from vllm_prefix_guard_harness.fuzz.oracle import MeteredDriver

COLUMNS = ("stock", "guard", "pr43569")
BLOCK_SIZE = 16
VOCAB = VOCAB_SIZE  # the factory's placeholder model; token ids only need to be below it


# -- workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Traffic:
    """Shared-prefix requests whose i-th member depends only on ``(seed, i)``.

    Each prompt is one of ``num_prefixes`` system prompts plus a unique suffix, so the
    prefix cache hits on every admission after the first of a group; output lengths vary
    so requests finish, and new ones are admitted, every few steps. A share of requests
    carries a long document whose prefill is chunked over several steps (see
    ``long_prefill_token_threshold`` in :meth:`Cell.scheduler_spec`): a chunk registers
    several blocks per step, which is what a same-step preemption can leave as zombies.
    Another share repeats a recent prompt verbatim (retries, ``n > 1`` fan-out), the
    readers that could hit such a zombie.
    """

    seed: int
    num_prefixes: int = 8
    prefix_blocks: int = 16
    suffix_range: tuple[int, int] = (16, 160)
    long_fraction: float = 0.1
    long_suffix_range: tuple[int, int] = (384, 1024)
    output_range: tuple[int, int] = (16, 192)
    num_priorities: int = 4
    duplicate_fraction: float = 0.1
    duplicate_window: int = 8

    @property
    def max_blocks_per_request(self) -> int:
        suffix = max(self.suffix_range[1], self.long_suffix_range[1])
        tokens = self.prefix_blocks * BLOCK_SIZE + suffix + self.output_range[1]
        return -(-tokens // BLOCK_SIZE)

    def prefixes(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        size = self.prefix_blocks * BLOCK_SIZE
        return [[rng.randrange(1, VOCAB) for _ in range(size)] for _ in range(self.num_prefixes)]

    def request(self, index: int, prefixes: list[list[int]]) -> tuple[list[int], int, int]:
        """``(prompt_token_ids, max_tokens, priority)`` of request ``index``."""
        rng = random.Random(self.seed * 1_000_003 + index)
        if index >= self.duplicate_window and rng.random() < self.duplicate_fraction:
            prompt, _, _ = self.request(index - rng.randint(1, self.duplicate_window), prefixes)
        else:
            long = rng.random() < self.long_fraction
            lengths = self.long_suffix_range if long else self.suffix_range
            suffix = [rng.randrange(1, VOCAB) for _ in range(rng.randint(*lengths))]
            prompt = prefixes[rng.randrange(self.num_prefixes)] + suffix
        return prompt, rng.randint(*self.output_range), rng.randrange(self.num_priorities)


@dataclass(frozen=True)
class Cell:
    """One benchmark configuration: scheduler shape, traffic and memory pressure.

    ``running`` is ``max_num_seqs``; a backlog of a quarter of it waits at all times, so
    without pressure the running set stays full. ``pressure`` sizes the KV cache below
    what the running set needs at its longest, so decode growth preempts requests every
    few steps; without it every request fits.
    """

    running: int
    policy: str  # "fcfs" or "priority"
    pressure: bool
    async_scheduling: bool

    @property
    def name(self) -> str:
        load = "pressure" if self.pressure else "nopressure"
        mode = "async" if self.async_scheduling else "sync"
        return f"{self.running}-{self.policy}-{load}-{mode}"

    @property
    def depth(self) -> int:
        """Steps in flight, as ``EngineCore`` runs them (batch queue of 2 under async)."""
        return 2 if self.async_scheduling else 1

    @property
    def backlog(self) -> int:
        return self.running + self.running // 4

    @property
    def traffic(self) -> Traffic:
        return Traffic(seed=self.running)

    @property
    def num_blocks(self) -> int:
        traffic = self.traffic
        shared = traffic.num_prefixes * traffic.prefix_blocks
        if not self.pressure:
            # Every request of the backlog at its longest, plus the prefixes: no preemption.
            return shared + traffic.max_blocks_per_request * self.backlog + 64
        # Unpressured, a running request holds 11-14 blocks on average (its share of the
        # prefixes included); 10 per running request makes decode growth preempt about
        # every other step, with ~80% of max_num_seqs running.
        return shared + 10 * self.running

    def scheduler_spec(self) -> SchedulerSpec:
        """What ``diagnostics.factory.make_scheduler`` builds for this cell."""
        return SchedulerSpec(
            block_size=BLOCK_SIZE,
            num_blocks=self.num_blocks,
            max_num_seqs=self.running,
            max_num_batched_tokens=8192,
            max_model_len=2048,
            policy=self.policy,
            long_prefill_token_threshold=256,
            async_scheduling=self.async_scheduling,
            enable_prefix_caching=True,
            reserve_full_isl=True,  # vLLM's default
        )


def default_cells(sizes: Iterable[int]) -> list[Cell]:
    """Per size: FCFS without and with pressure, PRIORITY with pressure; each sync and async.

    PRIORITY without pressure is left out: with no preemption the policy only reorders
    admission, which the guard does not touch.
    """
    return [
        Cell(running, policy, pressure, async_scheduling)
        for running in sizes
        for policy, pressure in (("fcfs", False), ("fcfs", True), ("priority", True))
        for async_scheduling in (False, True)
    ]


# -- one column's scheduler on the harness's engine loop ------------------------------------


def sampled_token(request_id: str, position: int) -> int:
    """The fake model's token at ``position`` of request ``r<i>``: a function of ``(i,
    position)``, so columns agree and repeated prompts still diverge, as sampled ones do."""
    index = int(request_id[1:])
    return (index * 7919 + position * 104_729) % (VOCAB - 1) + 1


_call = getattr(operator, "call", lambda method, *args: method(*args))  # 3.11+: C function


class TimedDriver(MeteredDriver):
    """The harness's engine loop and shadow-KV worker, timing the scheduler's calls only.

    :class:`~vllm_prefix_guard_harness.shadow_kv.Driver` runs ``schedule()`` and
    ``update_from_output()`` through :meth:`call_schedule` and :meth:`call_update`; here
    each is timed (``perf_counter_ns`` and thread CPU time) around that call alone, so the
    worker's execution, its audit of every read and the loop's bookkeeping stay outside.
    The call itself goes through ``operator.call``, the C function callgrind collects
    inside (``instructions.py``). ``schedule_ns``/``update_ns``/``cpu_ns`` hold the
    current engine iteration's; :meth:`Lane.iterate` resets them.
    """

    def __init__(self, scheduler: Any, depth: int, guard: Any) -> None:
        super().__init__(scheduler, depth, sample=sampled_token)
        # The guard counts the entries each step recorded (None: the stock column).
        self.stats = guard.stats if guard is not None else None
        self.profiler: cProfile.Profile | None = None
        self.schedule_ns = self.update_ns = self.cpu_ns = 0
        self.max_registrations_per_step = 0

    def call_schedule(self) -> Any:
        stats = self.stats
        tracked = stats.registrations_tracked if stats is not None else 0
        output, self.schedule_ns = self._timed(self.scheduler.schedule)
        if stats is not None:
            registered = stats.registrations_tracked - tracked
            if registered > self.max_registrations_per_step:
                self.max_registrations_per_step = registered
        return output

    def call_update(self, output: Any, result: Any) -> Any:
        outputs, self.update_ns = self._timed(self.scheduler.update_from_output, output, result)
        return outputs

    def _timed(self, method: Any, *args: Any) -> tuple[Any, int]:
        """``method(*args)`` and its wall time; its thread CPU time goes to ``cpu_ns``."""
        profiler = self.profiler
        perf, cpu = time.perf_counter_ns, time.thread_time_ns
        if profiler is not None:
            profiler.enable()
        c0 = cpu()
        t0 = perf()
        result = _call(method, *args)
        wall = perf() - t0
        self.cpu_ns += cpu() - c0
        if profiler is not None:
            profiler.disable()
        return result, wall


def mode_of(column: str) -> str:
    """``stock#2`` runs as ``stock``: repeat a column to measure the noise floor (A/A)."""
    return column.split("#", 1)[0]


def select(column: str) -> None:
    """Put vLLM's classes in ``column``'s mode (idempotent)."""
    from vllm_prefix_guard import plugin

    if mode_of(column) == "stock":
        plugin.undo()
    else:
        plugin.apply()


class Lane:
    """One column: its scheduler on a :class:`TimedDriver`, traffic cursor and counters.

    :meth:`iterate` tops the backlog up and runs one engine iteration (the driver's
    ``step``: ``EngineCore.step`` when sync, ``step_with_batch_queue``'s cadence when
    async), so each steady-state iteration is one ``schedule()`` and one
    ``update_from_output()``.
    """

    def __init__(self, cell: Cell, column: str) -> None:
        from vllm_prefix_guard import hooks
        from vllm_prefix_guard_harness.factory import make_scheduler

        self.cell, self.column = cell, column
        select(column)
        scheduler = make_scheduler(cell.scheduler_spec())
        self.in_flight_rollbacks: Any = None  # PR #43569's extra undos (pr43569 column)
        if mode_of(column) == "pr43569":
            from vllm_prefix_guard_harness.fuzz.pr43569 import EveryStepInFlight

            self.in_flight_rollbacks = EveryStepInFlight(scheduler.kv_cache_manager)
            hooks.attach_guard(scheduler, self.in_flight_rollbacks)
        self.guard = hooks.guard_of(scheduler)
        if mode_of(column) == "stock":
            pool = type(scheduler.kv_cache_manager.block_pool)
            assert self.guard is None and pool.__name__ == "BlockPool", "stock is guarded"
        else:
            assert self.guard is not None, "guarded scheduler without a guard"
        self.driver = TimedDriver(scheduler, cell.depth, self.guard)
        self.scheduler = scheduler
        self.traffic = cell.traffic
        self.prefixes = self.traffic.prefixes()
        self.next_index = 0
        self.admitting = True
        # Measured iterations (ns), and the whole run's counters.
        self.step_ns: list[int] = []
        self.step_cpu_ns: list[int] = []  # thread CPU time: immune to being descheduled
        self.schedule_ns: list[int] = []
        self.update_ns: list[int] = []
        self.running_sum = 0
        self.iterations = 0
        self.drain_iterations = 0

    @property
    def idle(self) -> bool:
        return not self.driver.in_flight and not self.scheduler.has_requests()

    def _top_up(self) -> None:
        from vllm_prefix_guard_harness.factory import make_request

        scheduler = self.scheduler
        while len(scheduler.requests) < self.cell.backlog:
            index = self.next_index
            self.next_index += 1
            prompt, max_tokens, priority = self.traffic.request(index, self.prefixes)
            scheduler.add_request(
                make_request(
                    f"r{index}",
                    prompt,
                    block_size=BLOCK_SIZE,
                    max_tokens=max_tokens,
                    priority=priority,
                    arrival_time=float(index),
                )
            )

    def iterate(self, measured: bool) -> None:
        if self.admitting:
            self._top_up()
        else:
            self.drain_iterations += 1
        self.iterations += 1
        driver = self.driver
        driver.schedule_ns = driver.update_ns = driver.cpu_ns = 0
        driver.step()
        if measured:
            self.schedule_ns.append(driver.schedule_ns)
            self.update_ns.append(driver.update_ns)
            self.step_ns.append(driver.schedule_ns + driver.update_ns)
            self.step_cpu_ns.append(driver.cpu_ns)
            self.running_sum += len(self.scheduler.running)

    def drain(self, limit: int = 100_000) -> None:
        """Stop admitting and step until every request finished and nothing is in flight."""
        self.admitting = False
        for _ in range(limit):
            if self.idle:
                return
            self.iterate(measured=False)
        raise RuntimeError(f"{self.column}: still busy after {limit} drain iterations")

    def counters(self) -> dict[str, Any]:
        driver = self.driver
        kv = driver.fuzz_kv
        zombies = dict.fromkeys((v.request_id, v.block_id) for v in kv.violations)
        out: dict[str, Any] = {
            "median_step_us": _median_us(self.step_ns),
            "median_schedule_us": _median_us(self.schedule_ns),
            "median_update_us": _median_us(self.update_ns),
            "p90_step_us": _quantile_us(self.step_ns, 0.9),
            "median_step_cpu_us": _median_us(self.step_cpu_ns),
            "hit_tokens": driver.hit_tokens + driver.preempted_hit_tokens,
            "query_tokens": driver.query_tokens + driver.preempted_query_tokens,
            "preemptions": driver.preemptions,
            "scheduled_tokens": driver.scheduled_tokens,
            "zombie_hit_tokens": kv.invalid_hit_tokens + kv.invalid_resume_hit_tokens,
            "zombie_hit_examples": list(zombies)[:5],
            "bad_kv_reads": driver.violations,
            "mean_running": round(self.running_sum / max(1, len(self.step_ns)), 1),
            "requests_admitted": self.next_index,
            "iterations": self.iterations,
            "drain_iterations": self.drain_iterations,
            "trajectory": f"{driver.trajectory & 0xFFFFFFFF:08x}",
        }
        guard = self.guard
        if guard is not None:
            stats = guard.counters()
            most = driver.max_registrations_per_step
            bound = self.cell.depth * most
            out["ledger"] = {
                **stats,
                "max_registrations_per_step": most,
                "peak_bound": bound,
                "peak_within_bound": stats["peak_uncommitted_entries"] <= bound,
                "idle_after_drain": guard.is_idle,
            }
            if self.in_flight_rollbacks is not None:
                out["ledger"]["in_flight_entries_rolled_back"] = self.in_flight_rollbacks.entries
        return out


def _median_us(samples: list[int]) -> float:
    return round(statistics.median(samples) / 1000, 2) if samples else 0.0


def _quantile_us(samples: list[int], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000, 2)


# -- a cell: interleaved segments ----------------------------------------------------------


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Collect, freeze and disable the cyclic GC, so a collection never lands on one
    column's timed call; on the way out leave vLLM stock and the GC as it was."""
    from vllm_prefix_guard import plugin

    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        plugin.undo()
        gc.enable()
        gc.unfreeze()


def rotated(columns: tuple[str, ...], turn: int) -> list[str]:
    """Turn ``t`` runs the columns rotated by ``t`` places: each leads equally often."""
    k = turn % len(columns)
    return list(columns[k:] + columns[:k])


@dataclass(frozen=True)
class Plan:
    """How long a cell runs: warm-up iterations, then segments of measured iterations.

    Each segment starts with ``settle`` unmeasured iterations: switching between stock
    and guard rewrites attributes of vLLM's classes, which invalidates the interpreter's
    specialised attribute lookups on them, and the first iteration after a switch pays
    for re-specialising (measured: +5-7% on that segment without settling, none after one
    settle iteration). Every column settles alike, so their trajectories stay aligned.
    """

    warmup: int
    segments: int
    segment_steps: int
    settle: int = 1

    @property
    def steps(self) -> int:
        return self.segments * self.segment_steps


def plan_for(running: int, quick: bool) -> Plan:
    """Most measured steps at 256 running, the size the overhead target is set at.

    Warm-up covers admission of the first wave plus most of its decode, so the measured
    window sees requests finishing and being admitted every step.
    """
    if quick:
        return Plan(warmup=60, segments=4, segment_steps=10)
    return {
        64: Plan(warmup=200, segments=40, segment_steps=16),
        256: Plan(warmup=200, segments=40, segment_steps=12),
        1024: Plan(warmup=150, segments=16, segment_steps=8),
    }.get(running, Plan(warmup=200, segments=20, segment_steps=12))


def segment_ratios(column: list[float], reference: list[float]) -> dict[str, Any]:
    """Median and quartiles of the per-segment ratios ``column / reference``."""
    ratios = [c / r for c, r in zip(column, reference, strict=True)]
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "median": round(statistics.median(ratios), 4),
        "q1": round(quartiles[0], 4),
        "q3": round(quartiles[-1], 4),
        "per_segment": [round(r, 4) for r in ratios],
    }


def run_cell(cell: Cell, plan: Plan, columns: tuple[str, ...], log: Any = sys.stdout) -> dict:
    """Build one lane per column, warm up, measure in rotated segments, then drain."""
    started = time.monotonic()
    lanes: dict[str, Lane] = {}
    wall: dict[str, list[float]] = {c: [] for c in columns}
    cpu: dict[str, list[float]] = {c: [] for c in columns}
    with frozen_heap():
        for column in columns:
            lanes[column] = Lane(cell, column)
        for turn in range(plan.warmup):
            for column in rotated(columns, turn):
                select(column)
                lanes[column].iterate(measured=False)
        for turn in range(plan.segments):
            for column in rotated(columns, turn):
                select(column)
                lane = lanes[column]
                for _ in range(plan.settle):
                    lane.iterate(measured=False)
                for _ in range(plan.segment_steps):
                    lane.iterate(measured=True)
                wall[column].append(statistics.median(lane.step_ns[-plan.segment_steps :]))
                cpu[column].append(statistics.median(lane.step_cpu_ns[-plan.segment_steps :]))
        for column in columns:
            select(column)
            lanes[column].drain()
    summary: dict[str, Any] = {"cell": cell.name, **dataclasses.asdict(cell)}
    summary.update(num_blocks=cell.num_blocks, depth=cell.depth, **dataclasses.asdict(plan))
    summary["columns"] = {}
    reference = columns[0]
    stock = lanes[reference].counters()
    for column in columns:
        counters = stock if column == reference else lanes[column].counters()
        if column != reference:
            counters.update(
                step_ratio=segment_ratios(wall[column], wall[reference]),
                cpu_step_ratio=segment_ratios(cpu[column], cpu[reference]),
                hit_ratio=_ratio(counters["hit_tokens"], stock["hit_tokens"]),
                preemption_ratio=_ratio(counters["preemptions"], stock["preemptions"]),
                same_trajectory_as_stock=counters["trajectory"] == stock["trajectory"],
            )
        summary["columns"][column] = counters
    summary["seconds"] = round(time.monotonic() - started, 1)
    parts = []
    for column in columns:
        counters = summary["columns"][column]
        part = f"{column}={counters['median_step_us']:.0f}us"
        if column != reference:
            part += (
                f" (x{counters['step_ratio']['median']:.3f}"
                f" cpu x{counters['cpu_step_ratio']['median']:.3f})"
            )
        parts.append(part)
    print(f"  {cell.name}: {'  '.join(parts)}  [{summary['seconds']}s]", file=log, flush=True)
    for lane in lanes.values():
        lane.scheduler.shutdown()
    lanes.clear()
    gc.collect()
    return summary


def _ratio(value: int, reference: int) -> float | None:
    if reference == 0:
        return 1.0 if value == 0 else None
    return round(value / reference, 6)


# -- profiling -----------------------------------------------------------------------------


def profile_cell(cell: Cell, plan: Plan, column: str, path: Path) -> None:
    """cProfile the measured scheduler calls of one column; print the top and save."""
    with frozen_heap():
        lane = Lane(cell, column)
        for _ in range(plan.warmup):
            lane.iterate(measured=False)
        profiler = lane.driver.profiler = cProfile.Profile()
        for _ in range(plan.steps):
            lane.iterate(measured=True)
        lane.driver.profiler = None
        lane.drain()
    profiler.dump_stats(str(path))
    stats = pstats.Stats(profiler)
    print(f"{cell.name} {column}: {plan.steps} steps, {stats.total_tt:.3f} s profiled")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(20)
    stats.print_stats("prefix_guard")
    print(f"profile written to {path}")


# -- CLI -----------------------------------------------------------------------------------


def write_results(
    out: Path | None, benchmark: str, columns: Iterable[str], started: float, cells: Any
) -> None:
    import vllm

    document = {
        "benchmark": benchmark,
        "environment": environment(vllm.__version__),
        "columns": list(columns),
        "seconds": round(time.monotonic() - started, 1),
        "cells": cells,
    }
    write_document(out, document)


def parse_columns(parser: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """``--columns``: stock first (ratios are against it), each optionally ``#suffixed``."""
    columns = tuple(c for c in text.split(",") if c)
    if not columns or mode_of(columns[0]) != "stock":
        parser.error("--columns must start with stock (ratios are against it)")
    if any(mode_of(c) not in COLUMNS for c in columns):
        parser.error(f"--columns takes {', '.join(COLUMNS)} (optionally with a #suffix)")
    return columns


def parse_cells(parser: argparse.ArgumentParser, sizes: str, names: str) -> list[Cell]:
    """``--sizes`` and ``--cells``: the default cells of those sizes, those named if any."""
    cells = default_cells(int(s) for s in sizes.split(","))
    if names:
        keep = set(names.split(","))
        cells = [c for c in cells if c.name in keep]
        if not cells:
            parser.error(f"no cell matches {names!r}")
    return cells


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024", help="running requests per cell")
    parser.add_argument("--cells", default="", help="comma-separated cell names to keep")
    parser.add_argument(
        "--columns", default=",".join(COLUMNS), help="first is the reference; stock#2 for A/A"
    )
    parser.add_argument("--segments", type=int, default=0, help="override measured segments")
    parser.add_argument("--segment-steps", type=int, default=0, help="override steps/segment")
    parser.add_argument("--warmup", type=int, default=0, help="override warm-up iterations")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument(
        "--profile", choices=COLUMNS, default=None, help="cProfile one column instead"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    columns = parse_columns(parser, args.columns)
    cells = parse_cells(parser, args.sizes, args.cells)

    started = time.monotonic()
    summaries = []
    for cell in cells:
        plan = plan_for(cell.running, args.quick)
        plan = dataclasses.replace(
            plan,
            warmup=args.warmup or plan.warmup,
            segments=args.segments or plan.segments,
            segment_steps=args.segment_steps or plan.segment_steps,
        )
        if args.profile:
            path = Path(f"/tmp/prefix-guard-{cell.name}-{args.profile}.prof")
            profile_cell(cell, plan, args.profile, path)
            continue
        summaries.append(run_cell(cell, plan, columns))
    if args.profile:
        return 0
    write_results(args.out, "scheduler", columns, started, summaries)
    return 0


if __name__ == "__main__":
    sys.exit(main())
