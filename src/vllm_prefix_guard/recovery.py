"""The rare paths: requests that already counted rolled-back blocks as computed.

A rollback removes a registration; it cannot take back what another request did with
it in the meantime. Two cases exist, and each reader is made to recompute:

- *same-step dependents*: a block rolled back on preemption inside ``schedule()`` that
  another request scheduled in the same call counted as computed (vLLM 0.32/0.33 cannot
  produce this: lookups run only when the running loop preempted nobody; a vLLM that can
  would otherwise attend over unwritten KV);
- *failed-load readers*: requests that still count KV of a failed load (or KV computed
  over it) as computed; the ledger finds them from the admissions of the steps in flight.

Every vLLM internal used here is in :data:`vllm_prefix_guard.targets.INTERNALS` and is
checked at start-up.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_prefix_guard.ledger import Admission, FailedLoads, StepLedger, blocks_read
from vllm_prefix_guard.log import logger
from vllm_prefix_guard.targets import CACHED_REQUEST_COLUMNS


def withdraw_dependents(scheduler: Any, output: Any, ledger: StepLedger) -> None:
    """Preempt every request scheduled in ``output`` that holds a contested block.

    A withdrawn dependent is preempted through the (wrapped) ``_preempt_request``, which
    rolls back its own open-step entries and may contest blocks a further request read:
    the loop runs until nothing is contested, so no block id survives into the next
    step (where it could name a block reused since).
    """
    manager = scheduler.kv_cache_manager
    withdrawn = 0
    while ledger.has_contested_blocks:
        contested = ledger.take_contested_blocks()
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
        now = time.monotonic()
        for request in dependents:
            num_scheduled = withdraw_from_output(output, request.request_id)
            # _update_after_schedule already advanced these for the withdrawn step.
            request.num_in_flight_tokens -= num_scheduled
            request.num_computed_tokens -= num_scheduled
            scheduler.running.remove(request)
            scheduler._preempt_request(request, now)
        withdrawn += len(dependents)
    count_dependents(ledger, withdrawn)


def withdraw_from_output(output: Any, request_id: str) -> int:
    """Remove ``request_id`` from a ``SchedulerOutput`` before it is dispatched.

    Every per-request column of ``scheduled_cached_reqs`` is rewritten
    (:data:`~vllm_prefix_guard.targets.CACHED_REQUEST_COLUMNS`, checked at start-up to
    cover every field), so the remaining requests stay aligned.

    Returns:
        The number of tokens that had been scheduled for it.
    """
    num_scheduled: int = output.num_scheduled_tokens.pop(request_id)
    output.total_num_scheduled_tokens -= num_scheduled
    output.scheduled_new_reqs = [r for r in output.scheduled_new_reqs if r.req_id != request_id]
    cached = output.scheduled_cached_reqs
    if request_id in cached.req_ids:
        index = cached.req_ids.index(request_id)
        for name, kind in CACHED_REQUEST_COLUMNS.items():
            column = getattr(cached, name, None)
            if column is None:
                continue
            if kind is list:
                if len(column) > index:  # columns used only by some setups stay empty
                    del column[index]
            elif kind is set:
                column.discard(request_id)
            else:
                column.pop(request_id, None)
    for per_request in (output.scheduled_spec_decode_tokens, output.scheduled_encoder_inputs):
        per_request.pop(request_id, None)
    return num_scheduled


def admissions_of(output: Any) -> list[Admission]:
    """The requests ``output`` admits (new or resumed from preemption): id, block ids per
    KV-cache group, and tokens computed when admitted (prefix-cache hit plus
    connector-loaded tokens, whose blocks come first)."""
    admitted: list[Admission] = [
        (new.req_id, new.block_ids, new.num_computed_tokens)
        for new in output.scheduled_new_reqs
        if new.block_ids
    ]
    cached = output.scheduled_cached_reqs
    resumed = cached.resumed_req_ids
    if resumed:
        for index, request_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[index]
            if request_id in resumed and block_ids:
                admitted.append((request_id, block_ids, cached.num_computed_tokens[index]))
    return admitted


class LiveScheduler:
    """The :class:`~vllm_prefix_guard.ledger.SchedulerView` of a real scheduler, taken
    when a step reports failed loads (before vLLM's own handling frees anything)."""

    def __init__(self, scheduler: Any) -> None:
        from vllm.v1.core.kv_cache_utils import get_group_id

        self._scheduler = scheduler
        self._group_of = get_group_id
        managers = scheduler.kv_cache_manager.coordinator.single_type_managers
        self.group_block_sizes: Sequence[int] = [int(manager.block_size) for manager in managers]
        self._running = {request.request_id for request in scheduler.running}

    def admissions(self, output: object) -> list[Admission]:
        return admissions_of(output)

    def starts(self, output: Any) -> dict[str, int]:
        starts = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return starts

    def holds(self, request_id: str, block_id: int) -> bool:
        if request_id not in self._running:
            return False
        return any(
            block_id in group
            for group in self._scheduler.kv_cache_manager.get_block_ids(request_id)
        )

    def block_size_of(self, key: Any) -> int:
        return int(self.group_block_sizes[self._group_of(key)])

    def computed_blocks(self, request: Any) -> Iterator[int]:
        """The blocks holding ``request``'s computed tokens, in every group."""
        return blocks_read(
            self._scheduler.kv_cache_manager.get_block_ids(request.request_id),
            request.num_computed_tokens,
            self.group_block_sizes,
        )


def rollback_failed_loads(
    scheduler: Any, output: Any, ledger: StepLedger, invalid: Any
) -> FailedLoads:
    """The ledger's failed-load rollback, told what it needs of this scheduler: the
    admissions of each step in flight, who holds which block, each group's block size."""
    return ledger.rollback_failed_loads(output, invalid, LiveScheduler(scheduler))


def preempt_failed_load_readers(scheduler: Any, ledger: StepLedger, undone: FailedLoads) -> None:
    """Preempt running requests that still count bad KV of a failed load as computed.

    vLLM truncates, for each invalid block, the first running request that holds it;
    under ``recompute`` it lets every other holder keep the block as computed, trusting
    the first to rewrite it before they read it, which the scheduler does not guarantee.
    So every reader the ledger found restarts (its in-flight output dropped, as
    ``reset_prefix_cache`` does), and so does a loader vLLM did not truncate below its
    first bad block in some KV-cache group (another holder came first).
    The ledger already rolled back what they computed over the bad KV.
    """
    readers, bad = undone.readers, undone.bad_blocks
    view = LiveScheduler(scheduler)
    victims = [
        request
        for request in scheduler.running
        if request.request_id in readers
        or (request.request_id in undone and any(b in bad for b in view.computed_blocks(request)))
    ]
    now = time.monotonic()
    for request in victims:
        scheduler.running.remove(request)
        scheduler._preempt_request(request, now, drop_stale_output=True)
    count_dependents(ledger, len(victims))


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


def count_dependents(ledger: StepLedger, preempted: int) -> None:
    """Count requests preempted for reading rolled-back blocks; warn the first time."""
    if not preempted:
        return
    first = ledger.stats.dependents_preempted == 0
    ledger.stats.dependents_preempted += preempted
    if first:
        logger().warning(
            "vllm-prefix-guard: preempted %d request(s) that counted rolled-back prefix-cache "
            "blocks as computed; they recompute (logged once per scheduler).",
            preempted,
        )
