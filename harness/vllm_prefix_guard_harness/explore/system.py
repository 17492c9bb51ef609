"""What the explorer steps: one lane per mode, all driven by the same named events.

A *lane* is one real vLLM scheduler (stock, the guard, or a mutation of the guard) with
the fuzzer's shadow-KV driver. A :class:`System` holds the lanes of one exploration and
applies each iteration's :class:`Step` to all of them, so a path (a sequence of steps)
means the same in every lane: events name requests and blocks, never positions in a
list a lane's own trajectory decides. An event that does not apply to a lane (an abort
of a request it already finished, a failure of a block it does not load) is nothing
there.

One iteration, as ``fuzz.runner`` runs a workload: the step's events (arrival, abort,
reset), then ``Driver.step()`` split in two around the choices that follow
``schedule()``: which of the blocks the new step loads fail, and whether the oldest step
in flight is dropped instead of completed.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any

from vllm_prefix_guard import plugin
from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard_harness.explore import digest
from vllm_prefix_guard_harness.explore.mutations import MUTATIONS
from vllm_prefix_guard_harness.explore.scope import Scope
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.fuzz.oracle import MeteredDriver
from vllm_prefix_guard_harness.fuzz.runner import awaits_dropped_output
from vllm_prefix_guard_harness.fuzz.workload import expand
from vllm_prefix_guard_harness.shadow_kv import StepPlan

#: Lane modes besides the mutations: vLLM as installed, and the guard.
BASE_MODES = ("stock", "guard")

# A block a step loads: (request id, index of the block in the request).
LoadedBlock = tuple[str, int]


@dataclass(frozen=True)
class Events:
    """What happens before an iteration's ``schedule()``."""

    arrive: tuple[int, ...] = ()  # indices into Scope.requests, in arrival order
    abort: str | None = None
    reset: bool = False

    def describe(self) -> list[str]:
        out = []
        out += [f"arrive r{index}" for index in self.arrive]
        if self.abort is not None:
            out.append(f"abort {self.abort}")
        if self.reset:
            out.append("reset")
        return out


@dataclass(frozen=True)
class Outcome:
    """What happens to the step just scheduled and the oldest step in flight."""

    failed: tuple[LoadedBlock, ...] = ()
    drop: bool = False

    def describe(self) -> list[str]:
        out = [f"load of {rid} block {index} fails" for rid, index in self.failed]
        if self.drop:
            out.append("oldest output dropped")
        return out


@dataclass(frozen=True)
class Step:
    events: Events = Events()
    outcome: Outcome = Outcome()

    def describe(self) -> str:
        return ", ".join(self.events.describe() + self.outcome.describe()) or "nothing"

    def to_json(self) -> list[Any]:
        e, o = self.events, self.outcome
        return [list(e.arrive), e.abort, e.reset, [list(b) for b in o.failed], o.drop]

    @classmethod
    def from_json(cls, data: list[Any]) -> Step:
        arrive, abort, reset, failed, drop = data
        return cls(
            Events(tuple(arrive), abort, reset), Outcome(tuple((r, i) for r, i in failed), drop)
        )


Path = tuple[Step, ...]


@dataclass
class Lane:
    """One mode's scheduler and driver."""

    mode: str
    scheduler: Any
    driver: MeteredDriver
    # The step scheduled in the current iteration (None: nothing was scheduled).
    new_plan: StepPlan | None = None
    # Requests released from vLLM's dropped-output wedge (see runner.awaits_dropped_output).
    released: int = 0
    # A dropped step admitted a request on a prefix hit: the hit was counted, and never
    # read, so whether it was valid is unknown (the path is not compared).
    unchecked_hits: bool = False

    @property
    def guard(self) -> Any:
        return guard_of(self.scheduler)

    @property
    def bad_reads(self) -> int:
        return self.driver.violations

    @property
    def hit_tokens(self) -> int:
        return self.driver.request_hit_tokens

    @property
    def event_steps_wrong(self) -> int:
        """Steps after which a KV-event consumer (set or counting) disagreed with the pool."""
        events = self.driver.events
        return (
            0 if events is None else events.inconsistent_steps + events.counted_inconsistent_steps
        )

    @property
    def drained(self) -> bool:
        return not self.scheduler.has_requests() and not self.driver.in_flight

    def live(self, request_id: str) -> bool:
        return request_id in self.scheduler.requests

    def arrive(self, scope: Scope, index: int, arrival: int) -> None:
        spec = scope.requests[index]
        request_id = f"r{index}"
        request = make_request(
            request_id,
            expand(spec.prompt),
            block_size=scope.block_size,
            max_tokens=spec.max_tokens,
            priority=spec.priority,
            arrival_time=float(arrival),
        )
        connector = self.scheduler.connector
        if connector is not None and spec.external_tokens:
            connector.external_tokens[request_id] = spec.external_tokens
        self.driver.add(request)

    def begin(self, scope: Scope, events: Events, arrival: int) -> None:
        """Apply ``events``, then schedule a step if the pipeline has room."""
        for offset, index in enumerate(events.arrive):
            self.arrive(scope, index, arrival + offset)
        if events.abort is not None and self.live(events.abort):
            self.driver.abort(events.abort)
        if events.reset:
            # vLLM may refuse it (see fuzz.runner._inject); the engine serves on.
            with contextlib.suppress(RuntimeError):
                self.scheduler.reset_prefix_cache(reset_running_requests=scope.reset_running)
        self.new_plan = None
        driver = self.driver
        if len(driver.in_flight) < driver.depth and self.scheduler.has_requests():
            driver.schedule()
            self.new_plan = driver.in_flight[-1]

    def loaded_blocks(self, block_size: int) -> list[LoadedBlock]:
        """The blocks the step just scheduled loads through the connector."""
        if self.new_plan is None:
            return []
        return [
            (load.request_id, position // block_size)
            for load in self.new_plan.loads
            for position in range(load.start, load.start + load.num_tokens, block_size)
        ]

    def fail_loads(self, failed: set[LoadedBlock], block_size: int) -> None:
        """Make the new step's loads of ``failed`` blocks fail (one load per block)."""
        plan = self.new_plan
        if plan is None or not plan.loads:
            return
        plan.loads = [
            part
            for load in plan.loads
            for part in load.per_block(
                block_size, lambda index, r=load.request_id: (r, index) in failed
            )
        ]

    def completes(self) -> bool:
        """Whether this iteration completes the oldest step in flight."""
        driver = self.driver
        return bool(driver.in_flight) and (
            len(driver.in_flight) >= driver.depth or not self.scheduler.has_requests()
        )

    def can_drop(self, block_size: int) -> bool:
        """Whether the oldest step in flight can be dropped here: a later step is in
        flight to come back first, and none of the later steps depends on the dropped
        one (schedules its requests, or reads a block it writes or loads). A step that
        a later one depends on cannot be lost alone: its loss would reach KV computed
        in flight, which no prefix-cache rule can take back."""
        in_flight = self.driver.in_flight
        if len(in_flight) < 2 or not self.completes():
            return False
        oldest = in_flight[0]
        requests = {read.request_id for read in oldest.reads}
        written = {load_block for load in oldest.loads for load_block in load.block_ids}
        for read in oldest.reads:
            end = read.start + read.num_tokens
            written.update(read.block_ids[read.start // block_size : -(-end // block_size)])
        for plan in list(in_flight)[1:]:
            for read in plan.reads:
                if read.request_id in requests:
                    return False
                if not written.isdisjoint(read.block_ids[: -(-read.start // block_size)]):
                    return False
        return True

    def finish(self, outcome: Outcome, scope: Scope, iteration: int) -> None:
        """Complete (or drop, then complete) the oldest step in flight, as due."""
        self.fail_loads(set(outcome.failed), scope.block_size)
        if not self.completes():
            return
        if outcome.drop and self.can_drop(scope.block_size):
            self.drop_oldest()
        self.driver.complete()
        if iteration >= scope.horizon:
            self.release_if_wedged()

    def drop_oldest(self) -> None:
        """The oldest step's output never comes back: the worker never ran it, vLLM
        never updates from it, and the engine fails the requests it scheduled (their
        output is lost). The next step's output then comes back first."""
        driver = self.driver
        plan = driver.in_flight.popleft()
        for read in plan.reads:
            if driver.fuzz_kv.admission_reads.pop(id(read), None) is not None:
                self.unchecked_hits = True
        for request_id in sorted({read.request_id for read in plan.reads}):
            if self.live(request_id):
                driver.abort(request_id, at_once=True)

    def release_if_wedged(self) -> None:
        """After the horizon: requests stuck on vLLM's dropped-output bug (a lane that
        scheduled nothing and has no work in flight, with such a request running) are
        aborted, and counted, as ``fuzz.runner`` does. An empty step alone is no stall:
        vLLM may hold decodes back for a step (decode staggering)."""
        if not self.scheduler.has_requests():
            return
        if any(plan.output.total_num_scheduled_tokens for plan in self.driver.in_flight):
            return
        if self.new_plan is not None and self.new_plan.output.total_num_scheduled_tokens:
            return
        stuck = [r.request_id for r in self.scheduler.running if awaits_dropped_output(r)]
        for request_id in stuck:
            self.driver.abort(request_id, at_once=True)
        self.released += len(stuck)

    def state(self) -> tuple[Any, ...]:
        return (
            self.mode,
            digest.scheduler_state(self.scheduler),
            digest.guard_state(self.guard),
            digest.driver_state(self.driver),
            digest.consumers_state(self.driver.events),
            self.released,
            self.unchecked_hits,
        )


def build_lane(scope: Scope, mode: str) -> Lane:
    """A lane built under its mode; the caller keeps the plugin applied while guarded
    lanes run (a stock lane, built without the guard, runs vLLM's code unchanged: the
    hooks pass through on a scheduler without a guard)."""
    if mode == "stock":
        plugin.undo()
        scheduler = make_scheduler(scope.spec())
        assert guard_of(scheduler) is None
    else:
        plugin.apply()
        scheduler = make_scheduler(scope.spec())
        if mode != "guard":
            MUTATIONS[mode].attach(scheduler)
        assert guard_of(scheduler) is not None, "prefix caching is off"
    return Lane(mode, scheduler, MeteredDriver(scheduler, scope.depth))


@dataclass
class System:
    """The lanes of one exploration and the explorer's own state."""

    scope: Scope
    lanes: list[Lane]
    iteration: int = 0
    arrived: tuple[int, ...] = ()
    aborted: tuple[str, ...] = ()
    # Per lane: whether it has read bad KV on this path, and whether its KV events have
    # disagreed with its pool.
    dirty: list[bool] = field(default_factory=list)
    events_wrong: list[bool] = field(default_factory=list)
    # The lanes whose KV events disagreed with the pool for the first time on this path,
    # in the iteration just finished.
    first_events_wrong: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, scope: Scope, modes: tuple[str, ...]) -> System:
        lanes = [build_lane(scope, mode) for mode in modes]
        if any(mode != "stock" for mode in modes):
            plugin.apply()
        return cls(scope, lanes, dirty=[False] * len(lanes), events_wrong=[False] * len(lanes))

    # -- choices -----------------------------------------------------------------------

    def event_options(self) -> list[Events]:
        """Every combination of events the scope allows at this iteration."""
        scope = self.scope
        if self.iteration >= scope.horizon:
            return [Events()]
        waiting = [i for i in range(len(scope.requests)) if i not in self.arrived]
        arrivals: list[tuple[int, ...]] = [()]
        for count in range(1, scope.arrivals_per_step + 1):
            if scope.arrivals == "fixed":
                arrivals += [tuple(waiting[:count])] if len(waiting) >= count else []
            else:
                arrivals += list(itertools.combinations(waiting, count))
        aborts: list[str | None] = [None]
        if scope.aborts:
            aborts += [
                f"r{i}"
                for i in self.arrived
                if f"r{i}" not in self.aborted and any(lane.live(f"r{i}") for lane in self.lanes)
            ]
        resets = [False, True] if scope.resets else [False]
        return [Events(a, b, c) for a, b, c in itertools.product(arrivals, aborts, resets)]

    def outcome_options(self) -> list[Outcome]:
        """Failure subsets of the blocks the new steps load, times drop or not."""
        scope = self.scope
        if self.iteration >= scope.horizon:
            return [Outcome()]
        failures: list[tuple[LoadedBlock, ...]] = [()]
        if scope.load_failures:
            loaded = sorted(
                {b for lane in self.lanes for b in lane.loaded_blocks(scope.block_size)}
            )
            failures = [
                subset
                for size in range(len(loaded) + 1)
                for subset in itertools.combinations(loaded, size)
            ]
        drops = [False]
        if scope.drops and any(lane.can_drop(scope.block_size) for lane in self.lanes):
            drops.append(True)
        return [Outcome(f, d) for f, d in itertools.product(failures, drops)]

    # -- applying a step ---------------------------------------------------------------

    def begin(self, events: Events) -> None:
        first_arrival = len(self.arrived) + 1
        self.arrived = (*self.arrived, *events.arrive)
        if events.abort is not None:
            self.aborted = (*self.aborted, events.abort)
        for lane in self.lanes:
            lane.begin(self.scope, events, first_arrival)

    def finish(self, outcome: Outcome) -> list[int]:
        """Complete the iteration; return the lanes that read bad KV for the first time
        on this path."""
        first_bad = []
        self.first_events_wrong = []
        for index, lane in enumerate(self.lanes):
            lane.finish(outcome, self.scope, self.iteration)
            if lane.bad_reads and not self.dirty[index]:
                self.dirty[index] = True
                first_bad.append(index)
            if lane.event_steps_wrong and not self.events_wrong[index]:
                self.events_wrong[index] = True
                self.first_events_wrong.append(index)
        self.iteration += 1
        return first_bad

    def apply(self, step: Step) -> list[int]:
        self.begin(step.events)
        return self.finish(step.outcome)

    # -- where the path stands ---------------------------------------------------------

    @property
    def done(self) -> bool:
        """Every lane drained, and no arrival can come any more."""
        if not all(lane.drained for lane in self.lanes):
            return False
        return self.iteration >= self.scope.horizon or len(self.arrived) == len(self.scope.requests)

    def hit_gap(self) -> int | None:
        """Guard hit tokens minus stock's while stock has read no bad KV on this path
        (None otherwise, without both lanes, or when a step stock dropped had admitted a
        request on a hit it never read): the path-by-path comparison."""
        modes = [lane.mode for lane in self.lanes]
        if "stock" not in modes or "guard" not in modes:
            return None
        stock = modes.index("stock")
        if self.dirty[stock] or self.lanes[stock].unchecked_hits:
            return None
        return self.lanes[modes.index("guard")].hit_tokens - self.lanes[stock].hit_tokens

    def guard_rolled_back(self) -> bool:
        """Whether the guard's lane undid entries on this path. Each one frees its block
        without a hash, which vLLM's pool reuses first while stock keeps it cached and
        evicts other blocks before it (``fuzz.differential.EVICTION_ORDER``): from there
        the two pools evict differently, and the guard may keep a valid block stock
        evicted. Measured on ``hybrid-priority``, vLLM 0.30: the guard undid three
        never-written state and attention entries of a preempted request; a later
        request hit 28 tokens under the guard, 24 in stock."""
        return any(lane.guard.stats.rolled_back > 0 for lane in self.lanes if lane.mode == "guard")

    def digest(self) -> int:
        """The state's digest: every lane's state, the explorer's, and what the path
        comparison carries (which lanes are dirty, the hit gap while stock is clean)."""
        return digest.digest_of(
            (
                self.iteration,
                self.arrived,
                self.aborted,
                tuple(self.dirty),
                tuple(self.events_wrong),
                self.hit_gap(),
                *(lane.state() for lane in self.lanes),
            )
        )


def replay(scope: Scope, path: Path | list[Step], modes: tuple[str, ...]) -> System:
    """The system after ``path``, stepped in this process (regression tests, shrinking
    a finding by hand). The caller restores the plugin (``plugin_restored``)."""
    system = System.build(scope, modes)
    for step in path:
        system.apply(step)
    return system


def drain(system: System) -> System:
    """Step with no events until done (or past the scope's last iteration)."""
    while not system.done:
        if system.iteration >= system.scope.max_iterations:
            break
        system.apply(Step())
    return system
