"""A canonical digest of everything that can influence a lane's future.

Two states with equal digests are explored once, so merging states that differ in
anything that matters would make the search unsound. The digest therefore errs on the
side of inclusion: instead of listing the fields of vLLM's ``Scheduler`` and
``Request`` (which change between releases), it takes every field whose value is plain
data (numbers, strings, enums, bytes, and containers of them), with requests named by
id and queues by their order; then the pool (free-queue order, each block's reference
count and hash, the hash -> blocks index), the KV-cache managers' per-request blocks,
the guard's records of the steps in flight, and the shadow worker (the steps in flight
with what they read, write and load, the failure reports they will see, and what every
KV slot and state block holds). What it leaves out is named in ``_SKIPPED``: statistics,
configuration fixed at build time, and memos that only speed up the oracle.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_prefix_guard_harness.pool_index import cached_block_ids

#: Fields of vLLM's objects that cannot change what happens next: statistics (counters
#: that only report), configuration fixed when the scheduler was built, and references
#: to the other objects digested on their own.
_SKIPPED = frozenset(
    {
        "prefix_cache_stats",
        "connector_prefix_cache_stats",
        "kv_metrics_collector",
        "metrics_collector",
        "perf_metrics",
        "spec_decode_metrics",
        "prefill_stats",
        "events",
        "vllm_config",
        "scheduler_config",
        "cache_config",
        "parallel_config",
        "observability_config",
        "lora_config",
        "kv_cache_config",
        "kv_events_config",
        # What the pool announces: read by consumers, never by the scheduler.
        "kv_event_queue",
        "sampling_params",
        "pooling_params",
        "structured_output_manager",
        "encoder_cache_manager",
        "kv_event_publisher",
        "kv_cache_manager",
        "connector",
        "block_pool",
        "blocks",
        "null_block",
        "_null_block",
        "free_block_queue",
        "cached_block_hash_to_block",
        "kv_cache_spec",
        "_block_hasher",
        "_prefix_guard",
        "_prefix_guard_publisher",
        "coordinator",
        "single_type_managers",
    }
)


class Unplain(Exception):
    """A value the generic canonical form does not cover (digested elsewhere or skipped)."""


def plain(value: Any) -> Any:
    """``value`` as nested tuples of plain data; requests become their ids."""
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return value
    if isinstance(value, enum.Enum):
        return (type(value).__name__, value.name)
    request_id = getattr(value, "request_id", None)
    if isinstance(request_id, str) and hasattr(value, "num_computed_tokens"):
        return ("request", request_id)
    if isinstance(value, Mapping):
        return ("map", tuple(sorted((repr(plain(k)), plain(v)) for k, v in value.items())))
    if isinstance(value, set | frozenset):
        return ("set", tuple(sorted(repr(plain(v)) for v in value)))
    if isinstance(value, array):  # vLLM 0.34's token ids (int32 ``TokenBuffer``)
        return tuple(value.tolist())
    if isinstance(value, list | tuple) or _is_queue(value):
        return tuple(plain(v) for v in value)
    if type(value).__name__ == "KVCacheBlock":
        # By id: the pool's state of every block is digested on its own (pool_state).
        # Blocks appear in vLLM's own fields, e.g. the deferred frees of async steps.
        return ("block", value.block_id)
    if type(value).__name__ == "BlockHashWithGroupId" or isinstance(value, bytes | bytearray):
        return bytes(value)
    raise Unplain(type(value).__name__)


def _is_queue(value: Any) -> bool:
    return type(value).__name__.endswith("RequestQueue") or type(value).__name__ == "deque"


def fields_of(obj: Any) -> tuple[Any, ...]:
    """Every plain field of ``obj`` (``vars``), by name; the others by type name only."""
    out = []
    for name, value in sorted(vars(obj).items()):
        if name in _SKIPPED or callable(value):
            continue
        try:
            out.append((name, plain(value)))
        except Unplain as unplain:
            out.append((name, ("unplain", str(unplain))))
    return tuple(out)


def scheduler_state(scheduler: Any) -> tuple[Any, ...]:
    """The scheduler's own fields, each request's, the managers' and the pool's."""
    manager = scheduler.kv_cache_manager
    requests = tuple(
        (request_id, fields_of(request), manager_blocks(manager, request_id))
        for request_id, request in sorted(scheduler.requests.items())
    )
    return (
        fields_of(scheduler),
        requests,
        tuple(fields_of(m) for m in manager.coordinator.single_type_managers),
        pool_state(manager.block_pool),
        connector_state(scheduler.connector),
    )


def manager_blocks(manager: Any, request_id: str) -> tuple[Any, ...]:
    return tuple(tuple(ids) for ids in manager.get_block_ids(request_id))


def pool_state(pool: Any) -> tuple[Any, ...]:
    """Free-queue order, every block's reference count and hash, the hash index (which
    may hold several blocks under one hash), and the pool's other plain fields (the
    guard's open record included)."""
    free = tuple(block.block_id for block in pool.free_block_queue.get_all_free_blocks())
    blocks = tuple((b.block_id, b.ref_cnt, _hash(b.block_hash)) for b in pool.blocks)
    index = tuple(
        sorted(
            (_hash(key), tuple(sorted(block_ids)))
            for key, block_ids in cached_block_ids(pool.cached_block_hash_to_block).items()
        )
    )
    return (free, blocks, index, fields_of(pool))


def _hash(key: Any) -> bytes | None:
    return None if key is None else bytes(key)


def connector_state(connector: Any) -> tuple[Any, ...] | None:
    if connector is None:
        return None
    return fields_of(connector)


def guard_state(guard: Any) -> tuple[Any, ...] | None:
    """The guard's records of the steps in flight, oldest first (steps by position)."""
    if guard is None:
        return None
    return tuple(
        tuple(
            (request_id, tuple((bytes(h), block.block_id, n) for h, block, n in entries))
            for request_id, entries in step_entries.items()
        )
        for _, step_entries in guard.rules.steps_in_flight()
    )


def driver_state(driver: Any) -> tuple[Any, ...]:
    """The steps in flight as the worker will execute them, the failure reports they
    will see, the aborts pending, every KV slot's content, and what every state block of
    a hybrid model's state groups holds (with the block each request resumes from).
    Step numbers (``written_at``) and counters are left out: only the audit reads them."""
    worker = driver.worker
    reports = worker.failure_reports
    in_flight = []
    admission = driver.fuzz_kv.admission_reads
    oldest_report = min((plan.reports_before for plan in driver.in_flight), default=len(reports))
    for plan in driver.in_flight:
        output = plan.output
        in_flight.append(
            (
                tuple(sorted(output.num_scheduled_tokens.items())),
                tuple(sorted(output.finished_req_ids)),
                tuple(sorted(output.preempted_req_ids or ())),
                tuple(
                    (
                        r.request_id,
                        r.start,
                        r.num_tokens,
                        tuple(r.block_ids),
                        r.samples,
                        admission.get(id(r)),
                        tuple(tuple(ids) for ids in r.state_block_ids),
                    )
                    for r in plan.reads
                ),
                tuple(
                    (
                        load.request_id,
                        load.start,
                        load.num_tokens,
                        tuple(load.block_ids),
                        load.fails,
                    )
                    for load in plan.loads
                ),
                plan.reports_before - oldest_report,
            )
        )
    kv = driver.kv
    return (
        tuple(in_flight),
        tuple(
            (tuple(sorted(reports[index][0])), tuple(sorted(worker.lost_by(index))))
            for index in range(oldest_report, len(reports))
        ),
        tuple(driver.pending_aborts),
        tuple(sorted((block, tuple(slots)) for block, slots in kv.slots.items())),
        tuple(
            (
                state.group,
                tuple(sorted(state.held.items())),
                tuple(sorted(state.last_written.items())),
            )
            for state in worker.states
        ),
        tuple(sorted(driver.admitted.items())),
        bool(kv.counts),
    )


def consumers_state(events: Any) -> tuple[Any, ...] | None:
    """What the KV-event consumers replayed beside the lane believe (None: events off)."""
    if events is None:
        return None
    return (
        tuple(sorted(map(repr, events.keys))),
        tuple(sorted((repr(key), count) for key, count in events.counts.items())),
    )


def digest_of(parts: Iterable[Any]) -> int:
    """A 64-bit digest of a canonical form (never 0: the visited table's empty slot)."""
    text = repr(tuple(parts)).encode()
    value = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")
    return value or 1
