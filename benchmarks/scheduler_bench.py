"""Scheduler overhead of the guard: per-step ``schedule()`` + ``update_from_output()`` time.

Runs vLLM's real ``Scheduler`` (``AsyncScheduler`` for async cells) with a fake worker in
steady state and compares three columns side by side, in one process:

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
  A scheduler built before ``apply()`` would go through the wrappers without a ledger,
  which is neither column; here each column's scheduler only ever runs in its own mode.
- The three schedulers live side by side and take turns in *segments* of a few steps
  (``stock guard pr43569``, the order rotated every segment), each replaying the same
  seeded traffic. On a shared, noisy VM a burst of foreign load then hits neighbouring
  segments of every column alike; the guard/stock ratio is taken per segment pair and
  the median of those ratios is the headline number.
- Only the two scheduler calls are timed (``perf_counter_ns``); the fake worker, request
  creation and bookkeeping sit outside the timed region. The cyclic GC is collected,
  frozen and disabled for the whole cell, so a collection never lands on one column.
- Under FCFS the guard changes no decision of vLLM's, so every column follows the same
  trajectory (checked with a digest of each step's shape) and step ``i`` of one column
  does the same work as step ``i`` of another. Under PRIORITY stock may serve *zombie*
  blocks (registered, then their writer preempted in the same ``schedule()``); the fake
  worker tracks which content each block holds and counts those hits, which the guard
  turns into misses, so trajectories part there.

Usage (from the repository root, in a venv with vLLM and this project installed)::

    python benchmarks/scheduler_bench.py --out benchmarks/results/scheduler.json
    python benchmarks/scheduler_bench.py --quick                  # smoke run, ~1 minute
    python benchmarks/scheduler_bench.py --cells 256-fcfs-pressure-sync --columns stock,stock#2
    python benchmarks/scheduler_bench.py --cells 256-fcfs-pressure-sync --profile guard
    python benchmarks/scheduler_bench.py --instructions --out benchmarks/results/instructions.json

``--instructions`` counts instructions per step under callgrind (valgrind), one process
per column: deterministic, so it answers what a noisy VM's clock cannot (1% or 5%?).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import gc
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from results_io import environment, write_document

COLUMNS = ("stock", "guard", "pr43569")
BLOCK_SIZE = 16
VOCAB = 1024  # the factory's placeholder model; token ids only need to be below it


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

    def scheduler_spec(self) -> dict[str, Any]:
        """Keyword arguments for ``testing.factory.make_scheduler``."""
        return dict(
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


# -- fake worker ---------------------------------------------------------------------------


def sampled_token(request_index: int, position: int) -> int:
    """The fake model's output at ``position``: fixed per request, so columns agree."""
    return (request_index * 7919 + position * 104_729) % (VOCAB - 1) + 1


class FakeRunner:
    """Executes scheduler outputs just enough for vLLM, and audits prefix-cache hits.

    It samples one token for every request whose scheduled chunk reaches its end, which is
    all ``update_from_output`` needs. It also tracks, per KV block, which content the last
    executed step left there, as ``(request, block index)`` (whose block hash names it):
    O(1) per scheduled request and step. A request entering with a prefix-cache hit (new,
    or resumed after preemption) reads its hit blocks; a hit block that does not hold the
    content the request's block hash names was never written for it: a zombie hit.
    Writes of a step land before its reads, as in one forward pass, so hitting a block
    registered and written in the same step is valid.
    """

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.block_size: int = scheduler.block_size
        manager = scheduler.kv_cache_manager.coordinator.single_type_managers[0]
        self.req_to_blocks = manager.req_to_blocks
        self.index_of: dict[str, int] = {}
        # block_id -> (request, block index) whose full content the block holds.
        self.content: dict[int, tuple[Any, int]] = {}
        self.zombie_hit_tokens = 0
        self.zombie_hits: list[tuple[str, int]] = []

    def plan(self, output: Any) -> tuple[Any, list[tuple[Any, ...]]]:
        """What ``output`` will do, captured right after ``schedule()`` returned it."""
        requests = self.scheduler.requests
        req_to_blocks = self.req_to_blocks
        size = self.block_size
        fresh = {r.req_id for r in output.scheduled_new_reqs}
        fresh.update(output.scheduled_cached_reqs.resumed_req_ids)
        work = []
        for req_id, num_tokens in output.num_scheduled_tokens.items():
            request = requests[req_id]
            end = request.num_computed_tokens
            start = end - num_tokens
            blocks = req_to_blocks[req_id]
            first = start // size
            touched = [blocks[i].block_id for i in range(first, (end - 1) // size + 1)]
            hits = [b.block_id for b in blocks[:first]] if req_id in fresh else None
            samples = not request.is_prefill_chunk
            work.append((req_id, request, start, end, first, touched, hits, samples))
        return output, work

    def execute(self, planned: tuple[Any, list[tuple[Any, ...]]]) -> Any:
        """Write the step's blocks, audit its hits, return its ``ModelRunnerOutput``."""
        from vllm.v1.outputs import ModelRunnerOutput

        _, work = planned
        size = self.block_size
        content = self.content
        for _, request, start, end, first, touched, _, _ in work:
            for offset, block_id in enumerate(touched):
                index = first + offset
                if (index + 1) * size <= end:
                    content[block_id] = (request, index)
                elif index * size >= start:
                    content.pop(block_id, None)  # begun anew: partial content only
        for req_id, request, _, _, _, _, hits, _ in work:
            if hits:
                self._audit(req_id, request, hits)
        index_of = self.index_of
        req_ids = [item[0] for item in work]
        sampled = [
            [sampled_token(index_of[req_id], end)] if samples else []
            for req_id, _, _, end, _, _, _, samples in work
        ]
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _audit(self, req_id: str, request: Any, hits: list[int]) -> None:
        expected = request.block_hashes
        for index, block_id in enumerate(hits):
            held = self.content.get(block_id)
            if held is not None:
                writer, written = held
                if writer.block_hashes[written] == expected[index]:
                    continue
            self.zombie_hit_tokens += self.block_size
            if len(self.zombie_hits) < 20:
                self.zombie_hits.append((req_id, block_id))


# -- columns -------------------------------------------------------------------------------


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


# -- one column's scheduler ----------------------------------------------------------------


class Lane:
    """One column: its scheduler, fake worker, traffic cursor, in-flight steps, counters.

    :meth:`iterate` is one ``EngineCore`` iteration: ``step`` when sync, and
    ``step_with_batch_queue``'s cadence when async (schedule while the queue has room,
    else complete the oldest step), so each steady-state iteration is one ``schedule()``
    and one ``update_from_output()``.
    """

    def __init__(self, cell: Cell, column: str) -> None:
        from vllm_prefix_guard import hooks
        from vllm_prefix_guard.diagnostics.factory import make_scheduler

        self.cell, self.column = cell, column
        select(column)
        self.scheduler = make_scheduler(**cell.scheduler_spec())
        self.ledger = hooks.ledger_of(self.scheduler)
        self.in_flight_rollbacks: Any = None  # PR #43569's extra undos (pr43569 column)
        if mode_of(column) == "stock":
            pool = type(self.scheduler.kv_cache_manager.block_pool)
            assert self.ledger is None and pool.__name__ == "BlockPool", "stock is guarded"
        else:
            assert self.ledger is not None, "guarded scheduler without a ledger"
            if mode_of(column) == "pr43569":
                from vllm_prefix_guard.diagnostics.fuzz.pr43569 import adopt_pr43569_scope

                self.in_flight_rollbacks = adopt_pr43569_scope(self.ledger)
        self.runner = FakeRunner(self.scheduler)
        self.traffic = cell.traffic
        self.prefixes = self.traffic.prefixes()
        self.next_index = 0
        self.in_flight: deque[tuple[Any, list[tuple[Any, ...]]]] = deque()
        self.admitting = True
        # Measured iterations (ns), and the whole run's counters.
        self.step_ns: list[int] = []
        self.step_cpu_ns: list[int] = []  # thread CPU time: immune to being descheduled
        self.schedule_ns: list[int] = []
        self.update_ns: list[int] = []
        self.running_sum = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.preemptions = 0
        self.scheduled_tokens = 0
        self.iterations = 0
        self.drain_iterations = 0
        self.max_registrations_per_step = 0
        self.digest = 0
        self.profiler: cProfile.Profile | None = None

    @property
    def idle(self) -> bool:
        return not self.in_flight and not self.scheduler.has_requests()

    def _top_up(self) -> None:
        from vllm_prefix_guard.diagnostics.factory import make_request

        scheduler = self.scheduler
        while len(scheduler.requests) < self.cell.backlog:
            index = self.next_index
            self.next_index += 1
            prompt, max_tokens, priority = self.traffic.request(index, self.prefixes)
            req_id = f"r{index}"
            self.runner.index_of[req_id] = index
            scheduler.add_request(
                make_request(
                    req_id,
                    prompt,
                    block_size=BLOCK_SIZE,
                    max_tokens=max_tokens,
                    priority=priority,
                    arrival_time=float(index),
                )
            )

    def iterate(self, measured: bool) -> None:
        scheduler, ledger, profiler = self.scheduler, self.ledger, self.profiler
        perf, cpu = time.perf_counter_ns, time.thread_time_ns
        cpu_ns = 0
        if self.admitting:
            self._top_up()
        else:
            self.drain_iterations += 1
        self.iterations += 1
        schedule_ns = update_ns = 0
        if len(self.in_flight) < self.cell.depth and scheduler.has_requests():
            tracked = ledger.stats.registrations_tracked if ledger is not None else 0
            if profiler is not None:
                profiler.enable()
            c0 = cpu()
            t0 = perf()
            output = scheduler.schedule()
            schedule_ns = perf() - t0
            cpu_ns = cpu() - c0
            if profiler is not None:
                profiler.disable()
            if ledger is not None:
                registered = ledger.stats.registrations_tracked - tracked
                if registered > self.max_registrations_per_step:
                    self.max_registrations_per_step = registered
            self.preemptions += len(output.preempted_req_ids or ())
            self.scheduled_tokens += output.total_num_scheduled_tokens
            self.digest = hash(
                (self.digest, output.total_num_scheduled_tokens, len(output.num_scheduled_tokens))
            )
            self.in_flight.append(self.runner.plan(output))
            if len(self.in_flight) < self.cell.depth and (
                output.total_num_scheduled_tokens or scheduler.has_requests()
            ):
                # step_with_batch_queue returns here: the queue has room for another step.
                self._record(measured, schedule_ns, 0, cpu_ns)
                return
        if self.in_flight:
            planned = self.in_flight.popleft()
            model_output = self.runner.execute(planned)
            if profiler is not None:
                profiler.enable()
            c0 = cpu()
            t0 = perf()
            outputs = scheduler.update_from_output(planned[0], model_output)
            update_ns = perf() - t0
            cpu_ns += cpu() - c0
            if profiler is not None:
                profiler.disable()
            for eco in outputs.values():
                stats = eco.scheduler_stats
                if stats is not None:
                    cache = stats.prefix_cache_stats
                    self.hit_tokens += cache.hits + cache.preempted_hits
                    self.query_tokens += cache.queries + cache.preempted_queries
        self._record(measured, schedule_ns, update_ns, cpu_ns)

    def _record(self, measured: bool, schedule_ns: int, update_ns: int, cpu_ns: int) -> None:
        if measured:
            self.schedule_ns.append(schedule_ns)
            self.update_ns.append(update_ns)
            self.step_ns.append(schedule_ns + update_ns)
            self.step_cpu_ns.append(cpu_ns)
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
        out: dict[str, Any] = {
            "median_step_us": _median_us(self.step_ns),
            "median_schedule_us": _median_us(self.schedule_ns),
            "median_update_us": _median_us(self.update_ns),
            "p90_step_us": _quantile_us(self.step_ns, 0.9),
            "median_step_cpu_us": _median_us(self.step_cpu_ns),
            "hit_tokens": self.hit_tokens,
            "query_tokens": self.query_tokens,
            "preemptions": self.preemptions,
            "scheduled_tokens": self.scheduled_tokens,
            "zombie_hit_tokens": self.runner.zombie_hit_tokens,
            "zombie_hit_examples": self.runner.zombie_hits[:5],
            "mean_running": round(self.running_sum / max(1, len(self.step_ns)), 1),
            "requests_admitted": self.next_index,
            "iterations": self.iterations,
            "drain_iterations": self.drain_iterations,
            "trajectory": f"{self.digest & 0xFFFFFFFF:08x}",
        }
        ledger = self.ledger
        if ledger is not None:
            stats = ledger.counters()
            bound = self.cell.depth * self.max_registrations_per_step
            out["ledger"] = {
                **stats,
                "max_registrations_per_step": self.max_registrations_per_step,
                "peak_bound": bound,
                "peak_within_bound": stats["peak_uncommitted_entries"] <= bound,
                "idle_after_drain": ledger.is_idle,
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
    from vllm_prefix_guard import plugin

    started = time.monotonic()
    lanes: dict[str, Lane] = {}
    wall: dict[str, list[float]] = {c: [] for c in columns}
    cpu: dict[str, list[float]] = {c: [] for c in columns}
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
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
    finally:
        plugin.undo()
        gc.enable()
        gc.unfreeze()
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
    from vllm_prefix_guard import plugin

    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        lane = Lane(cell, column)
        for _ in range(plan.warmup):
            lane.iterate(measured=False)
        lane.profiler = cProfile.Profile()
        for _ in range(plan.steps):
            lane.iterate(measured=True)
        profiler = lane.profiler
        lane.profiler = None
        lane.drain()
    finally:
        plugin.undo()
        gc.enable()
        gc.unfreeze()
    profiler.dump_stats(str(path))
    stats = pstats.Stats(profiler)
    print(f"{cell.name} {column}: {plan.steps} steps, {stats.total_tt:.3f} s profiled")  # type: ignore[attr-defined]
    stats.sort_stats("tottime").print_stats(20)
    stats.print_stats("prefix_guard")
    print(f"profile written to {path}")


# -- instruction counts (callgrind) -------------------------------------------------------


def callgrind_child(cell: Cell, column: str, warmup: int, steps: int) -> int:
    """Runs inside callgrind: warm up uninstrumented, then count the measured calls only.

    The scheduler calls go through ``operator.call`` (the C function ``_operator_call``,
    which callgrind collects inside via ``--toggle-collect``), so the fake worker and the
    bookkeeping are not counted. Instrumentation is switched on only after warm-up.
    """
    import operator
    import subprocess

    from vllm_prefix_guard import plugin

    gc.collect()
    gc.freeze()
    gc.disable()
    lane = Lane(cell, column)
    for _ in range(warmup):
        lane.iterate(measured=False)
    scheduler = lane.scheduler
    schedule, update = scheduler.schedule, scheduler.update_from_output
    scheduler.schedule = lambda *a: operator.call(schedule, *a)
    scheduler.update_from_output = lambda *a: operator.call(update, *a)
    pid = str(os.getpid())
    subprocess.run(["callgrind_control", "-i", "on", pid], check=True, capture_output=True)
    time.sleep(0.5)  # callgrind polls its command file
    for _ in range(steps):
        lane.iterate(measured=True)
    subprocess.run(["callgrind_control", "-i", "off", pid], check=True, capture_output=True)
    counters = lane.counters()
    print(json.dumps({"trajectory": counters["trajectory"], "ledger": counters.get("ledger")}))
    plugin.undo()
    return 0


def run_instructions(
    cells: list[Cell], columns: tuple[str, ...], warmup: int, steps: int
) -> list[dict[str, Any]]:
    """Instructions per measured step for each cell and column, one callgrind run each.

    Deterministic (PYTHONHASHSEED=0; repeated runs agree to 0.01%), so it settles what a
    shared VM's timings cannot: whether the guard adds 1% or 5% to the scheduler's work.
    Instructions are not time (cache misses are not counted), but the scheduler is
    interpreter-bound and the two move together.
    """
    import re
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    env = dict(os.environ, PYTHONHASHSEED="0")

    def one(cell: Cell, column: str) -> tuple[int, dict[str, Any]]:
        with tempfile.TemporaryDirectory() as tmp:
            command = [
                "valgrind", "--tool=callgrind", "--instr-atstart=no",
                "--collect-atstart=no", "--toggle-collect=_operator_call",
                f"--callgrind-out-file={tmp}/callgrind.out",
                sys.executable, __file__, "--callgrind-child", cell.name, column,
                str(warmup), str(steps),
            ]  # fmt: skip
            done = subprocess.run(command, env=env, capture_output=True, text=True)
        found = re.search(r"Collected : (\d+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise RuntimeError(f"callgrind run {cell.name}/{column} failed:\n{done.stderr[-2000:]}")
        return int(found.group(1)), json.loads(done.stdout.strip().splitlines()[-1])

    jobs = [(cell, column) for cell in cells for column in columns]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(lambda job: one(*job), jobs))
    by_job = dict(zip(jobs, results, strict=True))
    summaries = []
    for cell in cells:
        reference, _ = by_job[(cell, columns[0])]
        entry: dict[str, Any] = {"cell": cell.name, "warmup": warmup, "steps": steps}
        for column in columns:
            count, info = by_job[(cell, column)]
            entry[column] = {
                "instructions_per_step": count // steps,
                "ratio": round(count / reference, 4),
                "trajectory": info["trajectory"],
            }
        summaries.append(entry)
        line = "  ".join(
            f"{c}={entry[c]['instructions_per_step'] / 1e6:.2f}M (x{entry[c]['ratio']:.4f})"
            for c in columns
        )
        print(f"  {cell.name} instructions/step: {line}", flush=True)
    return summaries


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="64,256,1024", help="running requests per cell")
    parser.add_argument("--cells", default="", help="comma-separated cell names to keep")
    parser.add_argument(
        "--columns", default=",".join(COLUMNS), help="first is the reference; stock#2 for A/A"
    )
    parser.add_argument("--segments", type=int, default=0, help="override measured segments")
    parser.add_argument("--steps", type=int, default=0, help="measured steps (--instructions)")
    parser.add_argument("--segment-steps", type=int, default=0, help="override steps/segment")
    parser.add_argument("--warmup", type=int, default=0, help="override warm-up iterations")
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON results here")
    parser.add_argument(
        "--profile", choices=COLUMNS, default=None, help="cProfile one column instead"
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step under callgrind instead (default cell: 256 sync)",
    )
    parser.add_argument("--callgrind-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.callgrind_child:
        name, column, warmup, steps = args.callgrind_child
        cell = next(c for c in default_cells([int(name.split("-")[0])]) if c.name == name)
        return callgrind_child(cell, column, int(warmup), int(steps))

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    columns = tuple(c for c in args.columns.split(",") if c)
    if not columns or mode_of(columns[0]) != "stock":
        parser.error("--columns must start with stock (ratios are against it)")
    if any(mode_of(c) not in COLUMNS for c in columns):
        parser.error(f"--columns takes {', '.join(COLUMNS)} (optionally with a #suffix)")
    cells = default_cells(int(s) for s in args.sizes.split(","))
    if args.cells:
        keep = set(args.cells.split(","))
        cells = [c for c in cells if c.name in keep]
        if not cells:
            parser.error(f"no cell matches {args.cells!r}")

    started = time.monotonic()
    if args.instructions:
        if not args.cells:
            cells = [c for c in cells if c.name == "256-fcfs-nopressure-sync"] or cells[:1]
        counts = run_instructions(cells, columns, args.warmup or 150, args.steps or 15)
        write_results(args.out, "scheduler-instructions", columns, started, counts)
        return 0
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
