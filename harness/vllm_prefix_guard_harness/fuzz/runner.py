"""Run one :class:`Workload` against a real vLLM scheduler in one mode, and measure it.

Modes:

- ``stock``: the installed vLLM as is (the guard is undone while the scheduler is built
  and run);
- ``guard``: with ``vllm_prefix_guard.plugin.apply()``;
- ``pr43569``: the guard with upstream PR #43569's rollback scope (see ``pr43569``).

The engine loop is the shadow-KV :class:`Driver`: steps execute in dispatch order with
``workload.depth`` steps in flight, aborts land just before an update, and every read of
KV that was never written (or holds another prefix) is counted. Metrics (all exact):

- *hit tokens*: for each request, the tokens it starts with as already computed when
  first scheduled, minus the tokens the KV connector loads for it in that step: the
  local prefix-cache hit the scheduler acted on (vLLM's per-request
  ``num_cached_tokens`` without connector tokens). Read off the scheduled step, it
  means the same on every vLLM version; ``PrefixCacheStats`` counts a lookup again each
  step a request waits, and resumed requests again, so churn would inflate it;
- *computed tokens*: the sum of ``total_num_scheduled_tokens`` over all steps;
- *preemptions*: the sum of ``Request.num_preemptions`` (inside ``schedule()`` and by
  ``reset_prefix_cache``);
- the guard's counters (rollbacks by cause, peak uncommitted entries).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from vllm_prefix_guard import plugin
from vllm_prefix_guard.hooks import attach_guard, guard_of
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard.scheduler_guard import SchedulerGuard
from vllm_prefix_guard_harness.factory import (
    SchedulerSpec,
    hash_lookahead_tokens,
    make_request,
    make_scheduler,
)
from vllm_prefix_guard_harness.fuzz.audit import AuditCounts, IdealPolicy, RollbackAudit
from vllm_prefix_guard_harness.fuzz.oracle import MeteredDriver
from vllm_prefix_guard_harness.fuzz.pr43569 import EveryStepInFlight
from vllm_prefix_guard_harness.fuzz.workload import (
    Abort,
    Arrive,
    Fault,
    Reset,
    Workload,
    expand,
)
from vllm_prefix_guard_harness.shadow_kv import (
    NEVER_WRITTEN,
    OUTPUT_OVER_BAD_KV,
    STATE_NEVER_WRITTEN,
    STATE_WRONG_CONTENT,
    WRONG_CONTENT,
)

MODES = ("stock", "guard", "pr43569")
#: Not run by default: the guard with the shadow KV deciding its rollbacks (``audit``).
ORACLE_MODES = ("ideal",)

#: Iterations a run may go on after its last event, and after a request last finished,
#: before it is declared stalled. A backlog is no stall: ``hybrid-retry-async`` seed 4 at
#: the soak's horizon (vLLM 0.33, stock and guard alike) has 2,006 requests queued at its
#: last arrival and 876 still 5,000 iterations later; all finish within 4,100 more, never
#: 26 iterations without one finishing.
DRAIN_ITERATIONS = 5_000


@dataclass
class RunResult:
    """What one run of one workload in one mode did. Counters are exact."""

    mode: str
    steps: int = 0
    requests: int = 0
    never_written: int = 0
    wrong_content: int = 0
    # Steps that started a request from a wrong recurrent state (hybrid state groups):
    # each corrupts everything the request computes after it.
    bad_state_reads: int = 0
    # Steps whose read a pending failure report excused (a known loss only if vLLM then
    # recomputes it) and whose sampled token reached the client all the same.
    outputs_over_bad_kv: int = 0
    hit_tokens: int = 0
    # Hit tokens whose KV was never written or holds another prefix, and admissions
    # (resumes included) that read such KV.
    invalid_hit_tokens: int = 0
    bad_admissions: int = 0
    computed_tokens: int = 0
    loaded_tokens: int = 0
    preemptions: int = 0
    rolled_back_preempted: int = 0
    rolled_back_in_flight: int = 0
    rolled_back_kv_load_failure: int = 0
    rolled_back_dropped_step: int = 0
    dependents_preempted: int = 0
    peak_uncommitted_entries: int = 0
    # Reads not checked: their step held a block whose failed load vLLM then reported.
    discarded_reads: int = 0
    # reset_prefix_cache calls vLLM refused (it raised; the engine would serve on).
    resets_refused: int = 0
    # Runs wedged by vLLM's dropped-output bug (see awaits_dropped_output), and the
    # requests aborted to release them (the rest then drained and were checked).
    wedged_runs: int = 0
    released_requests: int = 0
    # Runs stopped with requests left DRAIN_ITERATIONS after the last event (or the
    # last release) for any other reason, and how many were left.
    stalled_runs: int = 0
    stalled_requests: int = 0
    # KV events (configurations with them on): keys a set consumer replayed from the
    # stream lacks or has in excess against the pool's index, summed over the steps after
    # which it disagreed, and how many such steps; the same for a counting consumer
    # (Dynamo's EventDedupFilter); keys a consumer held as stored that a rollback removed.
    kv_event_keys_missing: int = 0
    kv_event_keys_extra: int = 0
    kv_event_inconsistent_steps: int = 0
    kv_event_counted_keys_missing: int = 0
    kv_event_counted_keys_extra: int = 0
    kv_event_counted_inconsistent_steps: int = 0
    kv_event_keys_stored: int = 0
    kv_event_rolled_back_after_publish: int = 0
    # Digest of every step's decisions (MeteredDriver.decisions): equal digests, equal
    # trajectories. Meaningful between runs of one workload in one process.
    decisions: int = 0
    # ``decisions`` after each step (MeteredDriver.decision_history), and the step whose
    # execution first read bad KV (None: none did). Per run, not summed.
    decision_history: list[int] = field(default_factory=list)
    first_violation_step: int | None = None
    # Engine iteration whose step read bad KV first (None: no violation).
    first_violation_iteration: int | None = None
    # Up to the oracle's first 100 bad reads: (step, request, position, block, kind).
    examples: list[tuple[int, str, int, int, str]] = field(default_factory=list)
    seconds: float = 0.0
    # Rollback audit (run_workload(audit=True)): rolled-back entries by cause and verdict.
    audit: AuditCounts | None = None

    @property
    def violations(self) -> int:
        return (
            self.never_written
            + self.wrong_content
            + self.bad_state_reads
            + self.outputs_over_bad_kv
        )

    @property
    def valid_hit_tokens(self) -> int:
        """Hit tokens on KV that held the right content (stock's can include others)."""
        return self.hit_tokens - self.invalid_hit_tokens


@contextmanager
def plugin_restored() -> Iterator[None]:
    """Whatever the body does to the plugin, the process has it as before afterwards."""
    was_applied = plugin.is_applied()
    try:
        yield
    finally:
        if was_applied:
            plugin.apply()
        else:
            plugin.undo()


@contextmanager
def guard_state(on: bool) -> Iterator[None]:
    """Apply or undo the guard for the duration; restore what the process had.

    A scheduler keeps the hooks it was built under only while they stay applied, so the
    state must hold for the whole run, not just construction. (``apply()`` patches
    nothing when the installed vLLM already ships an equivalent fix: "guard" then
    measures that build.)
    """
    with plugin_restored():
        if on:
            plugin.apply()
        else:
            plugin.undo()
        yield


def run_workload(
    workload: Workload, mode: str, *, stop_on_violation: bool = False, audit: bool = False
) -> RunResult:
    """Run ``workload`` to completion (every request finished) in ``mode``.

    A run that still has requests ``DRAIN_ITERATIONS`` after its last event and after a
    request last finished is wedged if requests await an output vLLM dropped: they are
    aborted (counted) and the rest drains. Otherwise it is stopped and counted in
    ``stalled_runs``.

    Args:
        stop_on_violation: return right after the first step that read bad KV (the
            shrinker only needs to know whether a violation happens, and where).
    """
    if mode not in MODES + ORACLE_MODES:
        expected = ", ".join(MODES + ORACLE_MODES)
        raise ValueError(f"unknown mode {mode!r}; expected one of {expected}")
    started = time.perf_counter()
    with guard_state(mode != "stock"):
        scheduler = make_scheduler(workload.spec)
        driver = MeteredDriver(scheduler, workload.depth)
        rules: UncommittedPrefixCache | None = None
        if guard_of(scheduler) is not None:
            if mode == "pr43569":
                rules = EveryStepInFlight(scheduler.kv_cache_manager)
            elif mode == "ideal":
                rules = IdealPolicy(scheduler, driver)
            elif audit:
                rules = RollbackAudit(scheduler, driver)
            if isinstance(rules, RollbackAudit):
                attach_guard(scheduler, rules, rules.rollback_class)
            elif rules is not None:
                attach_guard(scheduler, rules)
        guard = guard_of(scheduler)
        requests = []
        pending = deque(workload.events)
        arrival = 0
        iteration = 0
        first_violation: int | None = None
        resets_refused = 0
        limit = workload.last_step + DRAIN_ITERATIONS
        released = 0
        unfinished = 0
        arrived: dict[str, Arrive] = {}
        while pending or scheduler.has_requests() or driver.in_flight:
            while pending and pending[0].step <= iteration:
                event = pending.popleft()
                if isinstance(event, Arrive):
                    arrival += 1
                    arrived[event.request_id] = event
                    requests.append(_arrive(driver, event, workload.spec, arrival))
                elif isinstance(event, Fault):
                    pending.extendleft(reversed(_retries(scheduler, arrived, iteration)))
                    driver.fault()
                elif not _inject(driver, event):
                    resets_refused += 1
            driver.step()
            iteration += 1
            if len(scheduler.requests) < unfinished:
                # A request finished: a backlog still draining is no stall.
                limit = max(limit, iteration + DRAIN_ITERATIONS)
            unfinished = len(scheduler.requests)
            if first_violation is None and driver.kv.counts:
                first_violation = iteration - 1
                if stop_on_violation:
                    break
            if iteration > limit:
                stuck = [r.request_id for r in scheduler.running if awaits_dropped_output(r)]
                if not stuck:
                    break
                for request_id in stuck:
                    driver.abort(request_id)
                released += len(stuck)
                limit = iteration + DRAIN_ITERATIONS
        result = _result(mode, driver, requests, guard, first_violation)
        result.resets_refused = resets_refused
        if isinstance(rules, RollbackAudit):
            result.audit = rules.finish()
            if isinstance(rules, IdealPolicy):
                result.audit.by_cause["(ideal: kept by the oracle)"] = Counter(
                    entries=rules.kept_entries, readers=rules.kept_readers
                )
        result.wedged_runs = int(released > 0)
        result.released_requests = released
        if iteration > limit:
            result.stalled_runs = 1
            result.stalled_requests = len(scheduler.running) + len(scheduler.waiting)
    result.seconds = time.perf_counter() - started
    return result


def awaits_dropped_output(request: Any) -> bool:
    """Whether ``request`` is stuck on a vLLM liveness bug, with or without the guard.

    Under async scheduling ``schedule()`` adds an output placeholder for each sampling
    request. When a step reports a failed KV load, ``update_from_output`` truncates the
    affected request and skips its output (``failed_kv_load_req_ids``) without taking
    that placeholder back. Traced on stock vLLM 0.32: a 159-token prompt whose load
    fails samples in step N (1 placeholder), decodes in step N+1 (2), is truncated to 32
    computed tokens when N reports (still 2), recomputes, and ends RUNNING with every
    token computed and 1 placeholder left: it waits for a token that never comes and is
    never scheduled again, holding its blocks (on a small pool the waiting queue then
    starves behind it).
    """
    from vllm.v1.request import RequestStatus

    return request.status == RequestStatus.RUNNING and request.num_output_placeholders > 0


def _arrive(driver: MeteredDriver, event: Arrive, spec: SchedulerSpec, arrival: int) -> Any:
    request = make_request(
        event.request_id,
        expand(event.prompt),
        block_size=spec.block_size,
        max_tokens=event.max_tokens,
        priority=event.priority,
        arrival_time=float(arrival),
        hash_lookahead_tokens=hash_lookahead_tokens(driver.scheduler),
        frontend_block_hashes=spec.frontend_block_hashes,
    )
    connector = driver.scheduler.connector
    if connector is not None:
        if event.external_tokens:
            connector.external_tokens[event.request_id] = event.external_tokens
        if event.fail_load:
            connector.fail_loads.add(event.request_id)
            if event.failed_blocks:
                connector.failed_blocks[event.request_id] = frozenset(event.failed_blocks)
        if event.async_load_steps:
            connector.async_loads[event.request_id] = event.async_load_steps
    driver.add(request)
    return request


def _retries(scheduler: Any, arrived: dict[str, Arrive], iteration: int) -> list[Arrive]:
    """What clients send again once a fault aborted their requests: each unfinished
    request, under a new ID, at once (no remote load)."""
    return [
        Arrive(iteration, f"{req_id}-retry", event.prompt, event.max_tokens, event.priority)
        for req_id, event in arrived.items()
        if req_id in scheduler.requests and not scheduler.requests[req_id].is_finished()
    ]


def _inject(driver: MeteredDriver, event: Abort | Reset) -> bool:
    """Apply an abort or a reset; False if vLLM refused the reset."""
    if isinstance(event, Abort):
        driver.abort(event.request_id)
        return True
    try:
        driver.scheduler.reset_prefix_cache(reset_running_requests=event.running)
    except RuntimeError:
        # With a KV-consuming connector and a step in flight, vLLM 0.33 defers freeing
        # the preempted requests' blocks (defer_block_free), so the reset cannot empty
        # the pool and raises. EngineCore returns that error to the caller and serves on.
        return False
    return True


def _result(
    mode: str,
    driver: MeteredDriver,
    requests: list[Any],
    guard: SchedulerGuard | None,
    first_violation: int | None,
) -> RunResult:
    counts = driver.kv.counts
    result = RunResult(
        mode=mode,
        steps=driver.steps,
        requests=len(requests),
        never_written=counts[NEVER_WRITTEN],
        wrong_content=counts[WRONG_CONTENT],
        bad_state_reads=counts[STATE_NEVER_WRITTEN] + counts[STATE_WRONG_CONTENT],
        outputs_over_bad_kv=counts[OUTPUT_OVER_BAD_KV],
        hit_tokens=driver.request_hit_tokens,
        invalid_hit_tokens=driver.fuzz_kv.invalid_hit_tokens,
        bad_admissions=driver.fuzz_kv.bad_admissions,
        discarded_reads=driver.fuzz_kv.discarded_reads,
        computed_tokens=driver.computed_tokens,
        loaded_tokens=driver.loaded_tokens,
        preemptions=sum(r.num_preemptions for r in requests),
        decisions=driver.decisions,
        decision_history=driver.decision_history,
        first_violation_step=driver.kv.violations[0].step if driver.kv.violations else None,
        first_violation_iteration=first_violation,
        examples=[
            (v.step, v.request_id, v.position, v.block_id, v.kind) for v in driver.kv.violations
        ],
    )
    if driver.events is not None:
        result.kv_event_keys_missing = driver.events.missing
        result.kv_event_keys_extra = driver.events.extra
        result.kv_event_inconsistent_steps = driver.events.inconsistent_steps
        result.kv_event_counted_keys_missing = driver.events.counted_missing
        result.kv_event_counted_keys_extra = driver.events.counted_extra
        result.kv_event_counted_inconsistent_steps = driver.events.counted_inconsistent_steps
        result.kv_event_keys_stored = driver.events.stored
        result.kv_event_rolled_back_after_publish = driver.events.rolled_back_after_publish
    if guard is not None:
        if isinstance(guard.rules, EveryStepInFlight):
            result.rolled_back_in_flight = guard.rules.entries
        stats = guard.stats
        result.rolled_back_preempted = stats.rolled_back_preempted
        result.rolled_back_kv_load_failure = stats.rolled_back_kv_load_failure
        result.rolled_back_dropped_step = stats.rolled_back_dropped_step
        result.dependents_preempted = stats.dependents_preempted
        result.peak_uncommitted_entries = stats.peak_uncommitted_entries
    return result
