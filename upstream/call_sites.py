"""Where the upstream series calls the rules: the only hand-written lines of each part.

Everything else a part adds to vLLM comes from the project's rules
(``src/vllm_prefix_guard/rules``) or its vLLM-style tests (``upstream/parts/``), written
in by ``series.py``. Each :class:`Edit` replaces one exact, unique piece of a vLLM
0.33.0 file (as the earlier parts left it); ``series.py`` fails if the piece is not
there exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Edit:
    """Replace ``old`` (found exactly once) by ``new`` in vLLM's file ``path``."""

    path: str
    old: str
    new: str


BLOCK_POOL = "vllm/v1/core/block_pool.py"
SCHEDULER = "vllm/v1/core/sched/scheduler.py"
KV_LOAD_TESTS = "tests/v1/kv_connector/unit/test_kv_load_failure_recovery.py"
#: vLLM's tests that build a scheduler with ``object.__new__`` and set, one by one, the
#: attributes ``update_from_output`` reads: each gets the new one.
BARE_SCHEDULER_TESTS = (
    "tests/v1/core/test_scheduler.py",
    "tests/v1/core/test_async_scheduler.py",
)

#: Part 1, the commit fence: the pool records every new entry of the open step; the
#: scheduler opens, closes, commits and resets the steps and rolls back a preemption.
COMMIT_FENCE: tuple[Edit, ...] = (
    Edit(
        BLOCK_POOL,
        """        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}
""",
        """        self._reuse_watchers: dict[int, Callable[[KVCacheBlock], None]] = {}

        # The record of the scheduler step being scheduled (see
        # `UncommittedPrefixCache`): every new prefix-cache entry is appended to
        # it, under the request that made it. None when no step is open.
        self.uncommitted_entries: StepCacheEntries | None = None
""",
    ),
    Edit(
        BLOCK_POOL,
        """                num_tokens=num_hash_tokens,
""",
        """                num_tokens=num_hash_tokens,
                request_id=request.request_id,
""",
    ),
    Edit(
        BLOCK_POOL,
        """            num_tokens=num_hash_blocks * self.hash_block_size,
""",
        """            num_tokens=num_hash_blocks * self.hash_block_size,
            request_id=request.request_id,
""",
    ),
    Edit(
        BLOCK_POOL,
        """        num_tokens: int | None,
    ) -> None:
        if block.block_hash == block_hash_with_group_id:
            return
""",
        """        num_tokens: int | None,
        request_id: str | None = None,
    ) -> None:
        if block.block_hash == block_hash_with_group_id:
            return
""",
    ),
    Edit(
        BLOCK_POOL,
        """        self.cached_block_hash_to_block.insert(block_hash_with_group_id, block)

    def move_block_hashes(""",
        """        self.cached_block_hash_to_block.insert(block_hash_with_group_id, block)
        if self.uncommitted_entries is not None:
            self.uncommitted_entries.setdefault(request_id, []).append(
                (block_hash_with_group_id, block, num_tokens)
            )

    def move_block_hashes(""",
    ),
    Edit(
        SCHEDULER,
        """from vllm.v1.core.sched.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
""",
        """from vllm.v1.core.sched.request_queue import (
    RequestQueue,
    SchedulingPolicy,
    create_request_queue,
)
from vllm.v1.core.sched.uncommitted import UncommittedPrefixCache
""",
    ),
    Edit(
        SCHEDULER,
        """        # Mamba managers already account for their speculative state blocks.
""",
        """        # Prefix-cache entries of the steps whose KV is not written yet.
        self.uncommitted_prefix_cache = (
            UncommittedPrefixCache(self.kv_cache_manager)
            if self.kv_cache_manager.enable_caching
            else None
        )
        # Mamba managers already account for their speculative state blocks.
""",
    ),
    Edit(
        SCHEDULER,
        """    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        self.current_step += 1
""",
        """    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        if self.uncommitted_prefix_cache is not None:
            self.uncommitted_prefix_cache.begin_step()
        self.current_step += 1
""",
    ),
    Edit(
        SCHEDULER,
        """            self._update_after_schedule(scheduler_output)
        return scheduler_output
""",
        """            self._update_after_schedule(scheduler_output)
        if self.uncommitted_prefix_cache is not None:
            self.uncommitted_prefix_cache.end_step(scheduler_output)
        return scheduler_output
""",
    ),
    Edit(
        SCHEDULER,
        """            "Only running requests can be preempted"
        )
""",
        """            "Only running requests can be preempted"
        )
        if self.uncommitted_prefix_cache is not None:
            # Its computed tokens are those of the steps already dispatched,
            # which write them; the step being scheduled will not run for it.
            self.uncommitted_prefix_cache.rollback_preempted(
                request.request_id, request.num_computed_tokens
            )
""",
    ),
    Edit(
        SCHEDULER,
        """            # Promote request to waiting or preempted.
            self._update_waiting_for_remote_kv(request)
""",
        """            # Promote request to waiting or preempted.
            if self.uncommitted_prefix_cache is None:
                self._update_waiting_for_remote_kv(request)
            else:
                # The connector finished writing the KV it caches.
                with self.uncommitted_prefix_cache.written():
                    self._update_waiting_for_remote_kv(request)
""",
    ),
    Edit(
        SCHEDULER,
        """            eco.scheduler_stats = stats

        return engine_core_outputs
""",
        """            eco.scheduler_stats = stats

        if self.uncommitted_prefix_cache is not None:
            self.uncommitted_prefix_cache.commit_step(scheduler_output)
        return engine_core_outputs
""",
    ),
    Edit(
        SCHEDULER,
        """        reset_successful = self.kv_cache_manager.reset_prefix_cache()
""",
        """        reset_successful = self.kv_cache_manager.reset_prefix_cache()
        if reset_successful and self.uncommitted_prefix_cache is not None:
            self.uncommitted_prefix_cache.reset()
""",
    ),
    *(
        Edit(
            path,
            """    scheduler.recompute_kv_load_failures = False
""",
            """    scheduler.recompute_kv_load_failures = False
    scheduler.uncommitted_prefix_cache = None
""",
        )
        for path in BARE_SCHEDULER_TESTS
    ),
)

#: Part 2, failed KV loads: roll back before vLLM handles the failure (which may free
#: the requests involved), preempt the readers of bad KV before the step's stats; the
#: pool caches a loader's recomputed blocks around those that loaded fine.
FAILED_KV_LOADS: tuple[Edit, ...] = (
    Edit(
        BLOCK_POOL,
        """        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
""",
        """        if num_cached_blocks >= num_full_blocks:
            return
        if self.cache_around_kept_blocks(
            request,
            blocks,
            num_cached_blocks,
            num_full_blocks,
            block_size,
            kv_cache_group_id,
            block_mask,
        ):
            # Around the blocks a failed KV load's rollback kept.
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
""",
    ),
    Edit(
        SCHEDULER,
        """from vllm.v1.core.kv_cache_utils import KVCacheBlock
""",
        """from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.core.sched.failed_kv_loads import FailedKVLoads
""",
    ),
    Edit(
        SCHEDULER,
        """        # Every GPU write enqueued by this and earlier steps has completed, so it is
        # safe to return deferred-free blocks to the pool.
""",
        """        failed_kv_loads = None
        if (
            self.uncommitted_prefix_cache is not None
            and kv_connector_output
            and kv_connector_output.invalid_block_ids
        ):
            # Before the failure is handled, which may free the requests.
            failed_kv_loads = self._roll_back_bad_kv(
                scheduler_output, kv_connector_output.invalid_block_ids
            )

        # Every GPU write enqueued by this and earlier steps has completed, so it is
        # safe to return deferred-free blocks to the pool.
""",
    ),
    Edit(
        SCHEDULER,
        """        # EC Connector: update state from worker-side EC connector output.
        if self.ec_connector is not None and ec_connector_output:
            self.ec_connector.update_connector_output(ec_connector_output)
""",
        """        # EC Connector: update state from worker-side EC connector output.
        if self.ec_connector is not None and ec_connector_output:
            self.ec_connector.update_connector_output(ec_connector_output)

        if failed_kv_loads is not None:
            self._preempt_bad_kv_readers(failed_kv_loads)
""",
    ),
    Edit(
        SCHEDULER,
        """        return engine_core_outputs

    def _ec_transfer_pending(""",
        """        return engine_core_outputs

    def _roll_back_bad_kv(
        self, scheduler_output: SchedulerOutput, bad_block_ids: set[int]
    ) -> FailedKVLoads:
        \"\"\"Remove the entries of `bad_block_ids` and of the KV computed over
        them in this and every later step in flight; a reader vLLM preempted
        since has its output in flight over bad KV, which is dropped.
        \"\"\"
        assert self.uncommitted_prefix_cache is not None
        failed_kv_loads = FailedKVLoads(self.uncommitted_prefix_cache)
        failed_kv_loads.roll_back(scheduler_output, bad_block_ids)
        failed_kv_loads.drop_stale_output(self.requests)
        return failed_kv_loads

    def _preempt_bad_kv_readers(self, failed_kv_loads: FailedKVLoads) -> None:
        \"\"\"Preempt the running requests that still count KV of a failed load
        (or KV computed over it) as computed; they recompute it.

        vLLM truncates the first running request that holds each invalid
        block; every other holder keeps it as computed, and the requests admitted
        on a hit of it in later steps in flight are not found at all.
        \"\"\"
        readers = [
            request for request in self.running if failed_kv_loads.reads_bad_kv(request)
        ]
        timestamp = time.monotonic()
        for request in readers:
            self.running.remove(request)
            self._preempt_request(request, timestamp, drop_stale_output=True)

    def _ec_transfer_pending(""",
    ),
    Edit(
        KV_LOAD_TESTS,
        """    # req_id -> num_computed_tokens
    # all the common prefix blocks will be computed by request1
    expected_computed_tokens = {
        request1.request_id: min(invalid_block_idxs) * scheduler.block_size,
        request2.request_id: common_prefix_len,
    }

    assert len(scheduler.running) == 2
    for request in scheduler.running:
        assert (
            request.num_computed_tokens == expected_computed_tokens[request.request_id]
        )
""",
        """    # Request 1 is truncated to its first invalid block. Request 2 hit the invalid
    # blocks in the step that loaded them and counted them as computed; nothing
    # makes request 1 rewrite them before request 2 reads them (its recompute is
    # chunked, it can be aborted, a newcomer can hit them meanwhile), so request 2
    # is preempted to recompute and the invalid blocks are no longer cached.
    assert scheduler.running == [request1]
    assert request1.num_computed_tokens == (
        min(invalid_block_idxs) * scheduler.block_size
    )
    assert request2.status == RequestStatus.PREEMPTED
    assert request2.num_computed_tokens == 0
    block_pool = scheduler.kv_cache_manager.block_pool
    for block_id in invalid_block_ids:
        assert block_pool.blocks[block_id].block_hash is None
""",
    ),
)

#: Part 3, KV events that stay true with several blocks per hash: ``BlockStored`` only
#: when no other block caches the hash yet, ``BlockRemoved`` only when no block caches
#: it any more, on every path that adds or removes one.
KV_EVENTS: tuple[Edit, ...] = (
    # first_copy_events copies a BlockStored with msgspec.structs.replace.
    Edit(
        BLOCK_POOL,
        """from typing import Any

from vllm.distributed.kv_events import (
""",
        """from typing import Any

import msgspec

from vllm.distributed.kv_events import (
""",
    ),
    Edit(
        BLOCK_POOL,
        """        new_hashes: list[ExternalBlockHash] | None = (
            [] if self.enable_kv_cache_events else None
        )
        for i, blk in enumerate(new_full_blocks):
""",
        """        new_hashes: list[ExternalBlockHash] | None = (
            [] if self.enable_kv_cache_events else None
        )
        # Position and first copy of each block in new_hashes (first_copy_events).
        copies: list[tuple[int, bool]] = []
        for i, blk in enumerate(new_full_blocks):
""",
    ),
    Edit(
        BLOCK_POOL,
        """            self._insert_block_hash(
                block_hash_with_group_id,
                blk,
                num_tokens=num_hash_tokens,
                request_id=request.request_id,
            )
            if new_hashes is not None:
                new_hashes.append(maybe_convert_block_hash(block_hash))
""",
        """            if new_hashes is not None:
                new_hashes.append(maybe_convert_block_hash(block_hash))
                first_copy = (
                    self.cached_block_hash_to_block.get_one_block(
                        block_hash_with_group_id
                    )
                    is None
                )
                copies.append((i, first_copy))
            self._insert_block_hash(
                block_hash_with_group_id,
                blk,
                num_tokens=num_hash_tokens,
                request_id=request.request_id,
            )
""",
    ),
    Edit(
        BLOCK_POOL,
        """            self.kv_event_queue.append(
                self._build_block_stored_event(
                    request,
                    block_hashes=new_hashes,
                    parent_block_hash=parent_block_hash,
                    start_token_idx=start_token_idx,
                    end_token_idx=end_token_idx,
                    block_size=block_size,
                    kv_cache_group_id=kv_cache_group_id,
                    extra_keys_list=extra_keys_list,
                    lookahead_token_ids=lookahead_token_ids,
                )
            )
""",
        """            stored = self._build_block_stored_event(
                request,
                block_hashes=new_hashes,
                parent_block_hash=parent_block_hash,
                start_token_idx=start_token_idx,
                end_token_idx=end_token_idx,
                block_size=block_size,
                kv_cache_group_id=kv_cache_group_id,
                extra_keys_list=extra_keys_list,
                lookahead_token_ids=lookahead_token_ids,
            )
            self.kv_event_queue.extend(self.first_copy_events(stored, copies))
""",
    ),
    Edit(
        BLOCK_POOL,
        """            removed_hashes = self._remove_cached_block_hashes(block)
            self._emit_block_removed_events(removed_hashes)
        self._insert_block_hash(
            block_hash_with_group_id,
            block,
            num_tokens=num_hash_blocks * self.hash_block_size,
            request_id=request.request_id,
        )
        if self.enable_kv_cache_events and not already_cached:
""",
        """            removed_hashes = self._remove_cached_block_hashes(block)
            self._emit_block_removed_events(removed_hashes)
        # Announced only where no other block caches the hash yet.
        first_copy = (
            self.cached_block_hash_to_block.get_one_block(block_hash_with_group_id)
            is None
        )
        self._insert_block_hash(
            block_hash_with_group_id,
            block,
            num_tokens=num_hash_blocks * self.hash_block_size,
            request_id=request.request_id,
        )
        if self.enable_kv_cache_events and not already_cached and first_copy:
""",
    ),
    Edit(
        BLOCK_POOL,
        """        if not self.enable_kv_cache_events:
            return
        for block_hash in block_hashes:
            self.kv_event_queue.append(
                BlockRemoved(""",
        """        if not self.enable_kv_cache_events:
            return
        for block_hash in self.uncached_block_hashes(block_hashes):
            self.kv_event_queue.append(
                BlockRemoved(""",
    ),
)
