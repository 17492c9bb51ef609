"""Where the upstream series calls the rules: the only hand-written lines of each part.

Everything else a part adds to vLLM comes from the project's rules
(``src/vllm_prefix_guard/rules``) or its vLLM-style tests (``upstream/inputs/parts/``), written
in by ``series.py``. Each :class:`Edit` replaces one exact, unique piece of a vLLM
0.33.0 file (as the earlier parts left it); ``series.py`` fails if the piece is not
there exactly once.
"""

from __future__ import annotations

import re
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

#: Part 1 too: every request finished at once (fault tolerance, after a fault in the
#: engine loop) leaves no step in flight to come back.
FINISH_ALL: tuple[Edit, ...] = (
    Edit(
        SCHEDULER,
        """        else:
            request_ids = self.requests.keys()
""",
        """        else:
            if self.uncommitted_prefix_cache is not None:
                # Every request at once (fault tolerance, after a fault): no
                # step in flight comes back.
                self.uncommitted_prefix_cache.drop_steps_in_flight()
            request_ids = self.requests.keys()
""",
    ),
)

#: Part 2, failed KV loads: roll back before vLLM handles the failure (which may free
#: the requests involved), preempt the readers of bad KV before the step's stats; the
#: pool caches a loader's recomputed blocks around those that loaded fine.
FAILED_KV_LOADS: tuple[Edit, ...] = (
    Edit(
        BLOCK_POOL,
        """        self.uncommitted_entries: StepCacheEntries | None = None
""",
        """        self.uncommitted_entries: StepCacheEntries | None = None
        # (Request ID, KV cache group ID) of each loader whose cached-block
        # count a failed KV load's rollback rewound below blocks that kept
        # their entry (see `cache_around_kept_blocks`).
        self.kept_block_owners: set[tuple[str, int]] = set()
""",
    ),
    Edit(
        BLOCK_POOL,
        """        if num_cached_blocks >= num_full_blocks:
            return
        new_full_blocks = blocks[num_cached_blocks:num_full_blocks]
""",
        """        if num_cached_blocks >= num_full_blocks:
            return
        if self.kept_block_owners and self.cache_around_kept_blocks(
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
#: Part 3's edits are the KV-events pull request's: those below as they are (the same
#: text in vLLM 0.33 and 0.34), the two that register a hash with part 1's
#: ``request_id=`` added (``_after_part_1``).
# first_copy_events copies a BlockStored with msgspec.structs.replace.
_MSGSPEC_IMPORT = Edit(
    BLOCK_POOL,
    """from typing import Any

from vllm.distributed.kv_events import (
""",
    """from typing import Any

import msgspec

from vllm.distributed.kv_events import (
""",
)
_FIRST_COPY_EVENT = Edit(
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
)
_LAST_COPY_REMOVED = Edit(
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
)

#: ``cache_full_blocks`` keeps where each new block's hash stands in ``new_hashes``.
_COPIES_LIST = Edit(
    BLOCK_POOL,
    """        new_hashes: list[ExternalBlockHash] | None = (
            [] if self.enable_kv_cache_events else None
        )
""",
    """        new_hashes: list[ExternalBlockHash] | None = (
            [] if self.enable_kv_cache_events else None
        )
        # Position and first copy of each block in new_hashes (first_copy_events).
        copies: list[tuple[int, bool]] = []
""",
)
#: ``cache_full_blocks`` notes whether each block caches its hash first.
_FIRST_COPY_FULL = Edit(
    BLOCK_POOL,
    """            self._insert_block_hash(
                block_hash_with_group_id,
                blk,
                num_tokens=num_hash_tokens,
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
            )
""",
)
#: ``cache_partial_block`` announces a hash only where no other block caches it.
_FIRST_COPY_PARTIAL = Edit(
    BLOCK_POOL,
    """        self._insert_block_hash(
            block_hash_with_group_id,
            block,
            num_tokens=num_hash_blocks * self.hash_block_size,
        )
        if self.enable_kv_cache_events and not already_cached:
""",
    """        # Announced only where no other block caches the hash yet.
        first_copy = (
            self.cached_block_hash_to_block.get_one_block(block_hash_with_group_id)
            is None
        )
        self._insert_block_hash(
            block_hash_with_group_id,
            block,
            num_tokens=num_hash_blocks * self.hash_block_size,
        )
        if self.enable_kv_cache_events and not already_cached and first_copy:
""",
)


def _after_part_1(edit: Edit) -> Edit:
    """``edit`` on vLLM as part 1 leaves it: every ``_insert_block_hash`` call there also
    passes the request that registers (``request_id=``)."""

    def add(text: str) -> str:
        return re.sub(
            r"( *)(num_tokens=[^\n]*,\n)", r"\1\2\1request_id=request.request_id,\n", text
        )

    return Edit(edit.path, add(edit.old), add(edit.new))


KV_EVENTS: tuple[Edit, ...] = (
    _MSGSPEC_IMPORT,
    _COPIES_LIST,
    _after_part_1(_FIRST_COPY_FULL),
    _FIRST_COPY_EVENT,
    _after_part_1(_FIRST_COPY_PARTIAL),
    _LAST_COPY_REMOVED,
)


# -- Pull requests against vLLM 0.34.0, each on its own (prs.py) ------------------------

CORE_TEST_UTILS = "tests/v1/core/utils.py"

#: Test helpers the pull requests' tests share, in vLLM's ``tests/v1/core/utils.py``.
CORE_TEST_HELPERS: tuple[Edit, ...] = (
    Edit(
        CORE_TEST_UTILS,
        """from vllm.v1.core.sched.async_scheduler import AsyncScheduler
""",
        """from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
""",
    ),
    Edit(
        CORE_TEST_UTILS,
        """from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
""",
        """from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
""",
    ),
    Edit(
        CORE_TEST_UTILS,
        """        kv_cache_planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs),
    )
""",
        '''        kv_cache_planning.get_global_kv_cache_groups(vllm_config, kv_cache_specs),
    )


def create_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 16,
    priority: int = 0,
    block_size: int = 16,
) -> Request:
    """A request with a prompt of its own."""
    global _none_hash_initialized
    if not _none_hash_initialized:
        init_none_hash(sha256)
        _none_hash_initialized = True
    sampling_params = SamplingParams(max_tokens=max_tokens)
    sampling_params.update_from_generation_config({}, EOS_TOKEN_ID)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        priority=priority,
        block_hasher=get_request_block_hasher(block_size, sha256),
    )


def update_step(
    scheduler: Scheduler, scheduler_output: SchedulerOutput, requests: list[Request]
) -> None:
    """Update the scheduler with a runner's output for a scheduled step: one
    token for each request but a prefill chunk."""
    scheduled = [
        request
        for request in requests
        if request.request_id in scheduler_output.num_scheduled_tokens
    ]
    model_runner_output = ModelRunnerOutput(
        req_ids=[request.request_id for request in scheduled],
        sampled_token_ids=[[] if r.is_prefill_chunk else [0] for r in scheduled],
    )
    scheduler.update_from_output(scheduler_output, model_runner_output)


def run_step(scheduler: Scheduler, requests: list[Request]) -> SchedulerOutput:
    """One synchronous engine step."""
    scheduler_output = scheduler.schedule()
    update_step(scheduler, scheduler_output, requests)
    return scheduler_output


def num_hit_tokens(
    scheduler: Scheduler, request: Request, max_cache_hit_length: int | None = None
) -> int:
    """Tokens a new request with `request`'s prompt finds in the prefix cache
    (all but its last token at most, or `max_cache_hit_length`)."""
    if max_cache_hit_length is None:
        max_cache_hit_length = request.num_prompt_tokens - 1
    return scheduler.kv_cache_manager.get_computed_blocks(
        request, max_cache_hit_length
    )[1]
''',
    ),
)

KV_CACHE_MANAGER = "vllm/v1/core/kv_cache_manager.py"

#: A request preempted in the ``schedule()`` that scheduled it (priority policy): its
#: blocks cached for that step's tokens are evicted before ``_preempt_request`` frees
#: them. Without the commit fence's record, the blocks say which they are: a cached
#: block's hash covers ``block_hash_num_tokens`` tokens.
#: ``KVCacheManager.evict_blocks_past``: the blocks say which tokens their hash covers.
_EVICT_BLOCKS_PAST = Edit(
    KV_CACHE_MANAGER,
    """        self.block_pool.evict_blocks(block_ids)

""",
    """        self.block_pool.evict_blocks(block_ids)

    def evict_blocks_past(self, request: Request, num_tokens: int) -> None:
        \"\"\"Evict from the prefix cache the blocks of `request` cached for
        tokens past its first `num_tokens`, which it will not compute.

        `allocate_slots` caches the blocks a step is about to compute, so that
        requests in the same batch can share them: the step must run.
        \"\"\"
        self.evict_blocks(
            {
                block.block_id
                for blocks in self.coordinator.get_blocks(request.request_id)
                for block in blocks
                if (block.block_hash_num_tokens or 0) > num_tokens
            }
        )

""",
)

EVICT_PREEMPTED_BLOCKS: tuple[Edit, ...] = (
    _EVICT_BLOCKS_PAST,
    Edit(
        SCHEDULER,
        """                        if preempted_req in scheduled_running_reqs:
                            preempted_req_id = preempted_req.request_id
                            scheduled_running_reqs.remove(preempted_req)
""",
        """                        if preempted_req in scheduled_running_reqs:
                            preempted_req_id = preempted_req.request_id
                            scheduled_running_reqs.remove(preempted_req)
                            # allocate_slots cached the blocks this step was to
                            # compute for it; it will not run them.
                            self.kv_cache_manager.evict_blocks_past(
                                preempted_req, preempted_req.num_computed_tokens
                            )
""",
    ),
    *CORE_TEST_HELPERS,
)

PREFIX_CACHING_TESTS = "tests/v1/core/test_prefix_caching.py"

#: KV events per hash, not per block: ``BlockStored`` when the first block caches a hash,
#: ``BlockRemoved`` when the last one loses it (the pool's methods come from the rules).
KV_EVENTS_PER_HASH: tuple[Edit, ...] = (
    _MSGSPEC_IMPORT,
    _COPIES_LIST,
    _FIRST_COPY_FULL,
    _FIRST_COPY_EVENT,
    _FIRST_COPY_PARTIAL,
    _LAST_COPY_REMOVED,
    Edit(
        PREFIX_CACHING_TESTS,
        """    # Evicting one group's last hashed block lowers the estimate to that group's.
    full_attention_blocks = manager.get_blocks(request.request_id).blocks[0]
    manager.block_pool.evict_blocks({full_attention_blocks[3].block_id})
    assert manager.estimate_cached_tokens(request) == 3 * block_size
""",
        '''    # Evicting one group's last hashed block lowers the estimate to that group's.
    full_attention_blocks = manager.get_blocks(request.request_id).blocks[0]
    manager.block_pool.evict_blocks({full_attention_blocks[3].block_id})
    assert manager.estimate_cached_tokens(request) == 3 * block_size


def _cache_prompt_twice(prompt: list[int]) -> tuple[KVCacheManager, list[list[int]]]:
    """A manager whose prefix cache holds `prompt`'s blocks twice: two requests
    computed it in one batch (no lookup between them), each into blocks of its
    own, and finished. Returns it and each copy's block IDs."""
    manager = make_kv_cache_manager(
        make_kv_cache_config(16, 8),
        max_model_len=128,
        enable_caching=True,
        hash_block_size=16,
        enable_kv_cache_events=True,
    )
    copies = []
    for request_id in ("a", "b"):
        request = make_request(request_id, prompt, 16, sha256)
        assert manager.allocate_slots(request, len(prompt)) is not None
        copies.append(list(manager.get_block_ids(request_id)[0]))
        manager.free(request)
    return manager, copies


def test_kv_events_name_a_hash_once_whatever_its_copies():
    """#55092: `BlockStored` when the first block caches a hash, `BlockRemoved`
    when the last one loses it, so that KV-event consumers keeping a set of
    hashes and those counting `BlockStored` per hash both match the cache."""
    prompt = list(range(32))
    manager, (copy_a, copy_b) = _cache_prompt_twice(prompt)
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]

    probe = make_request("probe", prompt + [0], 16, sha256)
    for copy, num_removed, num_hit_tokens in ((copy_a, 0, 32), (copy_b, 2, 0)):
        manager.block_pool.evict_blocks(set(copy))
        removed = [e for e in manager.take_events() if isinstance(e, BlockRemoved)]
        assert len(removed) == num_removed
        assert manager.get_computed_blocks(probe)[1] == num_hit_tokens


def test_block_stored_names_only_the_blocks_that_cache_a_hash_first():
    prompt, tail = list(range(32)), list(range(100, 116))
    manager, _ = _cache_prompt_twice(prompt)
    (prompt_stored,) = manager.take_events()
    request = make_request("c", prompt + tail, 16, sha256)
    assert manager.allocate_slots(request, len(prompt) + 16) is not None

    (stored,) = manager.take_events()
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 1
    assert stored.parent_block_hash == prompt_stored.block_hashes[-1]
    assert list(stored.token_ids) == tail
''',
    ),
)

INVALID_BLOCKS_TESTS = "tests/v1/kv_connector/unit/test_invalid_blocks_correctness.py"

#: Failed KV loads, inside vLLM's invalid-block handling: under either policy the invalid
#: blocks and those after them leave the prefix cache (those of a loader that finished
#: while its step ran, too); every holder recomputes from its first invalid block and
#: drops its output in flight; the first caches the blocks again.
INVALID_BLOCKS_EVICTED: tuple[Edit, ...] = (
    Edit(
        SCHEDULER,
        """            evict_blocks: Whether to collect blocks for eviction (False for
                async requests which aren't cached yet).
""",
        """            evict_blocks: Whether the requests' blocks are cached and their steps
                run (False for async loads): evict, cache again, drop output.
""",
    ),
    Edit(
        KV_CACHE_MANAGER,
        """        self.block_pool.evict_blocks(block_ids)

""",
        """        self.block_pool.evict_blocks(block_ids)

    def recache_blocks_from(self, request_id: str, block_index: int) -> None:
        \"\"\"Let a request cache its blocks from `block_index` on again once it
        recomputes them, after their entries were evicted. One KV cache group
        only: block indices differ between groups.
        \"\"\"
        (manager,) = self.coordinator.single_type_managers
        num_cached_blocks = manager.num_cached_block.get(request_id)
        if num_cached_blocks is not None and num_cached_blocks > block_index:
            manager.num_cached_block[request_id] = block_index

""",
    ),
    Edit(
        SCHEDULER,
        """        # Every GPU write enqueued by this and earlier steps has completed, so it is
        # safe to return deferred-free blocks to the pool.
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1
            self._drain_deferred_frees()
            self._drain_deferred_loads()
""",
        """        # Every GPU write enqueued by this and earlier steps has completed, so it is
        # safe to return deferred-free blocks to the pool (below, once the invalid
        # blocks among them are evicted).
        if self.defer_block_free and scheduler_output.total_num_scheduled_tokens > 0:
            self.processed_step_seq += 1
""",
    ),
    Edit(
        SCHEDULER,
        """                    num_scheduled_tokens,
                )
            )
        # NOTE(woosuk): As len(num_scheduled_tokens) can be up to 1K or more,
""",
        """                    num_scheduled_tokens,
                )
            )
        if self.defer_block_free:
            self._drain_deferred_frees()
            self._drain_deferred_loads()
        # NOTE(woosuk): As len(num_scheduled_tokens) can be up to 1K or more,
""",
    ),
    Edit(
        SCHEDULER,
        """        affected_req_ids: set[str] = set()
        total_affected_tokens = 0
        blocks_to_evict: set[int] = set()
        # If a block is invalid and shared by multiple requests in the batch,
        # these requests must be rescheduled, but only the first will recompute
        # it. This set tracks blocks already marked for recomputation.
        marked_invalid_block_ids: set[int] = set()
        for request in requests:
            is_affected = False
            marked_invalid_block = False
            req_id = request.request_id
""",
        """        affected_req_ids: set[str] = set()
        total_affected_tokens = 0
        blocks_to_evict: set[int] = set()
        # If a block is invalid and shared by multiple requests in the batch,
        # each recomputes it: one may run before another rewrites it (chunked
        # prefill, preemption). One caches it again: these are its blocks.
        recached_block_ids: set[int] = set()
        for request in requests:
            req_id = request.request_id
""",
    ),
    Edit(
        SCHEDULER,
        """                if block_id not in invalid_block_ids:
                    continue

                is_affected = True

                if block_id in marked_invalid_block_ids:
                    # This invalid block is shared with a previous request
                    # and was already marked for recomputation.
                    # This means this request can still consider this block
                    # as computed when rescheduled.
                    # Currently this only applies to sync loading; Async
                    # loading does not yet support block sharing
                    continue

                marked_invalid_block_ids.add(block_id)

                if marked_invalid_block:
                    # This request has already marked an invalid block for
                    # recomputation and updated its num_computed_tokens.
                    continue

                marked_invalid_block = True
                # Truncate the computed tokens at the first failed block
                request.num_computed_tokens = idx * self.block_size
                num_affected_tokens = (
                    req_num_computed_tokens - request.num_computed_tokens
                )
                total_affected_tokens += num_affected_tokens

                # collect invalid block and all downstream dependent blocks
                if evict_blocks:
                    blocks_to_evict.update(req_block_ids[idx:])

            if is_affected:
                if not marked_invalid_block:
                    # All invalid blocks of this request are shared with
                    # previous requests and will be recomputed by them.
                    # Revert to considering only cached tokens as computed.
                    # Currently this only applies to sync loading; Async
                    # loading does not yet support block sharing
                    total_affected_tokens += (
                        request.num_computed_tokens - req_num_computed_tokens
                    )
                    request.num_computed_tokens = req_num_computed_tokens

                affected_req_ids.add(request.request_id)
""",
        """                if block_id not in invalid_block_ids:
                    continue

                # Truncate the computed tokens at the first failed block
                request.num_computed_tokens = idx * self.block_size
                num_affected_tokens = (
                    req_num_computed_tokens - request.num_computed_tokens
                )
                total_affected_tokens += num_affected_tokens
                affected_req_ids.add(req_id)

                if evict_blocks:
                    # collect invalid block and all downstream dependent blocks
                    downstream_block_ids = req_block_ids[idx:]
                    blocks_to_evict.update(downstream_block_ids)
                    if recached_block_ids.isdisjoint(downstream_block_ids):
                        recached_block_ids.update(downstream_block_ids)
                        self.kv_cache_manager.recache_blocks_from(req_id, idx)
                    # Its steps in flight (async scheduling) computed over
                    # the failed block: drop their output.
                    request.spec_token_ids = []
                    request.drop_stale_output = True
                    request.num_stale_output_tokens = request.num_in_flight_tokens
                    request.num_output_placeholders = 0
                break
""",
    ),
    Edit(
        SCHEDULER,
        """        total_failed_requests += len(sync_failed_req_ids)
        total_failed_tokens += num_failed_tokens

        if not total_failed_requests:
            return set()

        # evict invalid blocks and downstream dependent blocks from cache
        # only when not using recompute policy (where blocks will be recomputed
        # and reused by other requests sharing them)
        if sync_blocks_to_evict and not self.recompute_kv_load_failures:
            self.kv_cache_manager.evict_blocks(sync_blocks_to_evict)
""",
        """        total_failed_requests += len(sync_failed_req_ids)
        total_failed_tokens += num_failed_tokens

        # A loader that finished while its step ran (async scheduling) left
        # its blocks to deferred_frees, in allocation order.
        for _, blocks in self.deferred_frees:
            for idx, block in enumerate(blocks):
                if block.block_id in invalid_block_ids:
                    sync_blocks_to_evict.update(b.block_id for b in blocks[idx:])
                    break

        # evict invalid blocks and downstream dependent blocks from cache
        # under either policy: recomputing them takes steps, in which other
        # requests would hit them.
        if sync_blocks_to_evict:
            self.kv_cache_manager.evict_blocks(sync_blocks_to_evict)

        if not total_failed_requests:
            return set()
""",
    ),
    Edit(
        KV_LOAD_TESTS,
        """    # req_id -> num_computed_tokens
    # all the common prefix blocks will be computed by request1
    expected_computed_tokens = {
        request1.request_id: min(invalid_block_idxs) * scheduler.block_size,
        request2.request_id: common_prefix_len,
    }
""",
        """    # req_id -> num_computed_tokens
    # both recompute from the first invalid block
    expected_computed_tokens = {
        request1.request_id: min(invalid_block_idxs) * scheduler.block_size,
        request2.request_id: min(invalid_block_idxs) * scheduler.block_size,
    }
""",
    ),
)

#: A fault in the engine loop (fault tolerance): ``on_fault`` finishes every request at
#: once, and the steps in flight never come back; each request's blocks cached past the
#: tokens of its steps that came back are evicted first.
EVICT_FAULTED_STEPS: tuple[Edit, ...] = (
    _EVICT_BLOCKS_PAST,
    Edit(
        SCHEDULER,
        """        else:
            request_ids = self.requests.keys()

        running_requests_to_remove = set()
""",
        """        else:
            # Every request at once (fault tolerance's on_fault): the steps in
            # flight never come back, so the blocks cached for them stay unwritten.
            for request in self.requests.values():
                self.kv_cache_manager.evict_blocks_past(
                    request, request.num_computed_tokens - request.num_in_flight_tokens
                )
            request_ids = self.requests.keys()

        running_requests_to_remove = set()
""",
    ),
)
