"""Scheduler hooks: drive each scheduler's :class:`StepLedger` through a step's life.

    Scheduler.__init__              attach a ledger to the (grafted) pool
    KVCacheCoordinator.__setattr__  graft the mixin onto whatever pool gets assigned
    Scheduler.schedule              begin the step; after it returns, resolve contested
                                    blocks, then dispatch the bucket with its output
    Scheduler._preempt_request      roll back the victim's open-step entries, before free
    Scheduler._update_waiting_for_remote_kv
                                    pause recording: its registrations are confirmed
    Scheduler.update_from_output    roll back failed KV loads, run, then commit the step
    Scheduler.reset_prefix_cache    drop every bucket once the pool was reset
    Scheduler.shutdown              one summary line with the counters (+ JSON file)

Data flows one way: hook -> ledger -> pool. Hooks on a scheduler without a ledger
(prefix caching off, or built before the guard was applied) call straight through.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from typing import Any

from vllm_prefix_guard import stats as guard_stats
from vllm_prefix_guard.ledger import StepLedger
from vllm_prefix_guard.patching import PatchRegistry
from vllm_prefix_guard.pool import GuardUnsupportedError, graft
from vllm_prefix_guard.targets import (
    COORDINATOR_MODULE,
    DISABLE_HINT,
    SCHEDULER_MODULE,
    SCHEDULER_TARGETS,
    resolve,
    vllm_version,
)

LEDGER_ATTR = "_prefix_guard_ledger"
STATS_FILE_ATTR = "_prefix_guard_stats_file"
STATS_FILE_ENV = "VLLM_PREFIX_GUARD_STATS_FILE"

AnyFn = Callable[..., Any]


def ledger_of(scheduler: Any) -> StepLedger | None:
    """The ledger the guard attached to ``scheduler``, if any."""
    ledger: StepLedger | None = getattr(scheduler, LEDGER_ATTR, None)
    return ledger


def attach_ledger(scheduler: Any) -> StepLedger | None:
    """Give ``scheduler`` a ledger over its pool; None when prefix caching is off."""
    manager = scheduler.kv_cache_manager
    if not getattr(manager, "enable_caching", False):
        return None
    check_manager(manager)
    pool = graft(manager.block_pool)  # in place: already shared by the managers
    ledger = StepLedger(pool)
    scheduler._prefix_guard_ledger = ledger
    guard_stats.track(ledger)
    path = os.environ.get(STATS_FILE_ENV)
    if path:
        scheduler._prefix_guard_stats_file = guard_stats.StatsFile(path)
    return ledger


def check_manager(manager: Any) -> None:
    """Instance state the rare paths use (dependents, failed loads): checked at start-up.

    Raises:
        GuardUnsupportedError: naming what is missing.
    """
    missing = [] if hasattr(manager, "get_block_ids") else ["KVCacheManager.get_block_ids"]
    coordinator = getattr(manager, "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    if managers is None:
        missing.append("KVCacheCoordinator.single_type_managers")
    else:
        for single in managers:
            for name in ("req_to_blocks", "num_cached_block"):
                if not hasattr(single, name):
                    missing.append(f"{type(single).__name__}.{name}")
    if missing:
        raise GuardUnsupportedError(
            f"vllm-prefix-guard does not support this vLLM ({vllm_version()}): "
            f"{', '.join(sorted(set(missing)))} missing. {DISABLE_HINT}"
        )


# -- wrappers (each takes the original and returns the replacement) ------------------


def wrap_init(original: AnyFn) -> AnyFn:
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        attach_ledger(self)

    return __init__


def wrap_schedule(original: AnyFn) -> AnyFn:
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        ledger = self._prefix_guard_ledger
        if ledger is None:
            return original(self, *args, **kwargs)
        ledger.begin_step()
        try:
            output = original(self, *args, **kwargs)
            if ledger.contested_blocks:
                withdraw_dependents(self, output, ledger)
        except BaseException:
            ledger.abandon_step()
            raise
        ledger.dispatch_step(output)
        return output

    return schedule


def wrap_preempt_request(original: AnyFn) -> AnyFn:
    def _preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        ledger = self._prefix_guard_ledger
        if ledger is not None and ledger.open is not None:
            ledger.rollback_preempted(request.request_id)
        return original(self, request, *args, **kwargs)

    return _preempt_request


def wrap_update_waiting_for_remote_kv(original: AnyFn) -> AnyFn:
    def _update_waiting_for_remote_kv(self: Any, *args: Any, **kwargs: Any) -> Any:
        ledger = self._prefix_guard_ledger
        if ledger is None:
            return original(self, *args, **kwargs)
        with ledger.paused():
            return original(self, *args, **kwargs)

    return _update_waiting_for_remote_kv


def wrap_update_from_output(original: AnyFn) -> AnyFn:
    def update_from_output(
        self: Any, scheduler_output: Any, model_runner_output: Any, *args: Any, **kwargs: Any
    ) -> Any:
        ledger = self._prefix_guard_ledger
        if ledger is None:
            return original(self, scheduler_output, model_runner_output, *args, **kwargs)
        kv_output = model_runner_output.kv_connector_output
        undone: dict[str, set[int]] = {}
        if kv_output is not None and kv_output.invalid_block_ids:
            undone = ledger.rollback_failed_loads(scheduler_output, kv_output.invalid_block_ids)
            if undone:
                rewind_cached_block_counts(self, undone)
        result = original(self, scheduler_output, model_runner_output, *args, **kwargs)
        if undone:
            preempt_failed_load_sharers(self, scheduler_output, ledger, undone)
        ledger.commit_step(scheduler_output)
        stats_file = self._prefix_guard_stats_file
        if stats_file is not None:
            stats_file.maybe_write(ledger.stats)
        return result

    return update_from_output


def wrap_reset_prefix_cache(original: AnyFn) -> AnyFn:
    def reset_prefix_cache(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        ledger = self._prefix_guard_ledger
        if ledger is not None and ledger.pool.guard_epoch != ledger._epoch:
            ledger.clear()
        return result

    return reset_prefix_cache


def wrap_shutdown(original: AnyFn) -> AnyFn:
    def shutdown(self: Any, *args: Any, **kwargs: Any) -> Any:
        ledger = self._prefix_guard_ledger
        if ledger is not None:
            report_counters(ledger, self._prefix_guard_stats_file)
        return original(self, *args, **kwargs)

    return shutdown


def wrap_coordinator_setattr(original: AnyFn | None) -> AnyFn:
    """``KVCacheCoordinator.__setattr__`` that grafts any pool assigned to ``block_pool``.

    Hooking the assignment (not the constructor, not the ``BlockPool`` name) catches
    vLLM's own pool and any later replacement (kvcached swaps in its pool after vLLM's
    ``__init__``), whichever wrapper runs last. Reads stay plain attribute loads: a data
    descriptor would put a Python call on every ``self.block_pool`` in vLLM's hot path,
    and storing through ``__dict__`` would de-optimise every attribute of the object.
    """
    store = original or object.__setattr__

    def __setattr__(self: Any, name: str, value: Any) -> None:
        if name == "block_pool" and getattr(value, "enable_caching", False):
            # The first assignment is vLLM's constructor handing over the pool it built.
            value = graft(value, fresh=not hasattr(self, "block_pool"))
        store(self, name, value)

    return __setattr__


_WRAPPERS: dict[str, Callable[[AnyFn], AnyFn]] = {
    "__init__": wrap_init,
    "schedule": wrap_schedule,
    "update_from_output": wrap_update_from_output,
    "_preempt_request": wrap_preempt_request,
    "reset_prefix_cache": wrap_reset_prefix_cache,
    "_update_waiting_for_remote_kv": wrap_update_waiting_for_remote_kv,
    "shutdown": wrap_shutdown,
}


def install(registry: PatchRegistry) -> list[str]:
    """Apply every hook through ``registry``; return the patched targets' names."""
    scheduler_cls = resolve(SCHEDULER_MODULE, "Scheduler")
    patched = []
    for target in SCHEDULER_TARGETS:
        registry.apply(scheduler_cls, target.name, _WRAPPERS[target.name])
        patched.append(target.qualname)
    # Class-level defaults, so the hooks read plain attributes on any scheduler.
    registry.apply(scheduler_cls, LEDGER_ATTR, lambda _: None)
    registry.apply(scheduler_cls, STATS_FILE_ATTR, lambda _: None)
    coordinator_cls = resolve(COORDINATOR_MODULE, "KVCacheCoordinator")
    registry.apply(coordinator_cls, "__setattr__", wrap_coordinator_setattr)
    patched.append("KVCacheCoordinator.__setattr__")
    return patched


# -- rare paths: dependents of a rollback, failed loads, shutdown -----------------------


def withdraw_dependents(scheduler: Any, output: Any, ledger: StepLedger) -> None:
    """Preempt every request scheduled in ``output`` that holds a contested block.

    A contested block was registered by a request preempted later in the same
    ``schedule()`` call, after another request hit it. The victim will not write it,
    so the reader is taken out of the step and recomputes from scratch. vLLM 0.32/0.33
    cannot produce this (lookups run only if the running loop preempted nobody); a
    vLLM that can would otherwise attend over unwritten KV here.
    """
    contested = ledger.contested_blocks
    manager = scheduler.kv_cache_manager
    dependents = [
        request
        for request in scheduler.running
        if request.request_id in output.num_scheduled_tokens
        and any(
            block_id in contested
            for group in manager.get_block_ids(request.request_id)
            for block_id in group
        )
    ]
    contested.clear()
    now = time.monotonic()
    for request in dependents:
        num_scheduled = withdraw_from_output(output, request.request_id)
        # _update_after_schedule already advanced these for the withdrawn step.
        request.num_in_flight_tokens -= num_scheduled
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now)
    _count_dependents(ledger, len(dependents))


def preempt_failed_load_sharers(
    scheduler: Any, output: Any, ledger: StepLedger, undone: dict[str, set[int]]
) -> None:
    """Preempt running requests that still count a block whose load failed as computed.

    vLLM truncates the request that loaded the block; under ``recompute`` it lets every
    other holder keep the block as computed, trusting the first to rewrite it before they
    read it, which the scheduler does not guarantee. Each such sharer restarts (its
    in-flight output dropped, as ``reset_prefix_cache`` does), and its registrations from
    the failing step on, computed over the invalid KV, are rolled back.
    """
    from vllm.v1.core.kv_cache_utils import get_block_hash

    failed = set().union(*undone.values())
    block_size = scheduler.block_size
    manager = scheduler.kv_cache_manager
    sharers = []
    for request in scheduler.running:
        if request.request_id in undone:
            continue
        computed = -(-request.num_computed_tokens // block_size)
        block_ids = manager.get_block_ids(request.request_id)[0][:computed]
        if not failed.isdisjoint(block_ids):
            sharers.append(request)
    # A reader preempted or finished since (a later step in flight did it) holds no
    # blocks to look at; its prefix hashes tell whether it registered on top of the
    # failed blocks' content. Conservative: at worst valid entries are dropped.
    failed_hashes = {get_block_hash(key) for key in ledger.failed_keys}
    ledger.failed_keys.clear()
    running = {request.request_id for request in scheduler.running}
    for request_id in ledger.requests_from(output) - undone.keys() - running:
        request = scheduler.requests.get(request_id)
        if request is not None and not failed_hashes.isdisjoint(request.block_hashes):
            ledger.rollback_request_from(output, request_id)
    now = time.monotonic()
    for request in sharers:
        ledger.rollback_request_from(output, request.request_id)
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now, drop_stale_output=True)
    _count_dependents(ledger, len(sharers))


def _count_dependents(ledger: StepLedger, preempted: int) -> None:
    """Count requests preempted for reading rolled-back blocks; warn the first time."""
    if not preempted:
        return
    first = ledger.stats.dependents_preempted == 0
    ledger.stats.dependents_preempted += preempted
    if first:
        _logger().warning(
            "vllm-prefix-guard: preempted %d request(s) that counted rolled-back prefix-cache "
            "blocks as computed; they recompute (logged once per scheduler).",
            preempted,
        )


def withdraw_from_output(output: Any, request_id: str) -> int:
    """Remove ``request_id`` from a ``SchedulerOutput`` before it is dispatched.

    Returns:
        The number of tokens that had been scheduled for it.
    """
    num_scheduled: int = output.num_scheduled_tokens.pop(request_id)
    output.total_num_scheduled_tokens -= num_scheduled
    output.scheduled_new_reqs = [r for r in output.scheduled_new_reqs if r.req_id != request_id]
    cached = output.scheduled_cached_reqs
    if request_id in cached.req_ids:
        index = cached.req_ids.index(request_id)
        for field in dataclasses.fields(cached):
            value = getattr(cached, field.name)
            if isinstance(value, list) and len(value) > index:
                del value[index]
            elif isinstance(value, set):
                value.discard(request_id)
            elif isinstance(value, dict):
                value.pop(request_id, None)
    for per_request in (output.scheduled_spec_decode_tokens, output.scheduled_encoder_inputs):
        per_request.pop(request_id, None)
    return num_scheduled


def rewind_cached_block_counts(scheduler: Any, undone: dict[str, set[int]]) -> None:
    """Let requests that keep their blocks re-register them once recomputed.

    After a failed load is rolled back, a request that stays (policy ``recompute``)
    would otherwise skip those blocks forever: its manager's ``num_cached_block`` still
    counts them. Only lowered when every block from there on is unhashed, which is what
    ``cache_full_blocks`` asserts for the blocks it (re)registers.
    """
    for manager in scheduler.kv_cache_manager.coordinator.single_type_managers:
        for request_id, block_ids in undone.items():
            blocks = manager.req_to_blocks.get(request_id)
            num_cached = manager.num_cached_block.get(request_id)
            if not blocks or num_cached is None:
                continue
            first = next(
                (i for i, b in enumerate(blocks[:num_cached]) if b.block_id in block_ids), None
            )
            if first is not None and all(
                b.block_hash is None for b in blocks[first:num_cached] if not b.is_null
            ):
                manager.num_cached_block[request_id] = first


def report_counters(ledger: StepLedger, stats_file: guard_stats.StatsFile | None) -> None:
    """One INFO line with the counters, and a last write of the stats file if any."""
    counters = ledger.stats.as_dict()
    _logger().info(
        "vllm-prefix-guard counters: %s", " ".join(f"{k}={v}" for k, v in counters.items())
    )
    if stats_file is not None:
        stats_file.write(ledger.stats)


def _logger() -> Any:
    from vllm_prefix_guard.plugin import logger

    return logger()
