# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries of a request that a step's output leaves out.

vLLM's runners compute every request of a step they were given, one aborted
while the step runs included, and list each in their output. A worker that
drops an aborted request from a step it was already given (the worker of
#56525's report) writes none of the KV the step registered for it. These tests
pin that such entries are removed, and that a request admitted on a hit of them
in a step in flight is preempted to recompute (its output of that step
dropped). An output that lists the aborted request keeps its entries, as
before (`test_abort_while_step_in_flight_keeps_its_entries` in
`test_uncommitted_prefix_cache.py`). On a hybrid model the reader may hit such
a state only through a copy: a Mamba partial prefix-cache hit copies the
checkpoint it hits into a block of its own before its step runs.
"""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from ..kv_connector.unit.utils import create_model_runner_output
from .test_scheduler import create_requests_with_priority

# A worker's output listing the step's requests among those given (none: all left
# out); a hybrid model's scheduler (full attention plus a Mamba group in align mode,
# its state block four attention blocks, so a prefix hit may end inside one, on a
# checkpoint of the state at that attention-block boundary).
from .test_uncommitted_prefix_cache import (
    create_mamba_request,
    create_mamba_scheduler,
    model_runner_output,
    num_hit_tokens,
)
from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


def abort_in_flight(async_scheduling: bool) -> tuple[Scheduler, list[Request]]:
    """A's 64-token prefill is dispatched, then A is aborted while it runs."""
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        async_scheduling=async_scheduling,
    )
    requests = create_requests(num_requests=2, num_tokens=64, same_prompt=True)
    scheduler.add_request(requests[0])
    return scheduler, requests


def test_entries_of_a_request_left_out_are_removed():
    """The output leaves A out: its step wrote none of A's blocks, so none of
    them stays cached."""
    scheduler, [aborted, _] = abort_in_flight(async_scheduling=False)
    in_flight = scheduler.schedule()
    assert num_hit_tokens(scheduler, aborted) == 48
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(in_flight, model_runner_output(in_flight, []))
    assert num_hit_tokens(scheduler, aborted) == 0  # 48 before this fix
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0


def test_retry_admitted_on_a_request_left_out_recomputes():
    """#56525's shape: async scheduling, the aborted prefill is retried at once
    and admitted on a hit of its blocks in the next step, dispatched before the
    aborted request's step reports. That report leaves the aborted request out:
    the retry is preempted before its own step's output is read (which is then
    dropped), and recomputes with nothing cached to hit."""
    scheduler, requests = abort_in_flight(async_scheduling=True)
    aborted, retry = requests
    in_flight = scheduler.schedule()
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(retry)
    retried = scheduler.schedule()
    [admitted] = retried.scheduled_new_reqs
    assert admitted.num_computed_tokens == 48

    scheduler.update_from_output(in_flight, model_runner_output(in_flight, [retry]))
    assert retry.status == RequestStatus.PREEMPTED
    assert retry.num_computed_tokens == 0
    assert num_hit_tokens(scheduler, retry) == 0
    outputs = scheduler.update_from_output(
        retried, model_runner_output(retried, [retry])
    )
    assert not any(output.outputs for output in outputs.values())
    assert retry.num_output_tokens == 0

    recomputed = scheduler.schedule()
    assert recomputed.num_scheduled_tokens == {retry.request_id: 64}


def test_retry_resumed_while_left_out_has_its_entries_removed():
    """A's second chunk is left out (A aborted). The retry, admitted on a hit of
    it in the next step, is preempted at that report with its output dropped,
    so it resumes at once, from fewer tokens: it computes A's second chunk
    again and registers it. Aborted and left out of both steps, its entries
    of the resuming step name tokens below where it started in the first one;
    they were never written either, and go."""
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        async_scheduling=True,
        max_num_batched_tokens=32,
        max_model_len=128,
    )
    aborted, retry = create_requests(num_requests=2, num_tokens=64, same_prompt=True)
    scheduler.add_request(aborted)
    first_chunk = scheduler.schedule()
    left_out = scheduler.schedule()
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(
        first_chunk, model_runner_output(first_chunk, [aborted])
    )
    scheduler.add_request(retry)
    retried = scheduler.schedule()
    [admitted] = retried.scheduled_new_reqs
    assert admitted.num_computed_tokens == 48

    scheduler.update_from_output(left_out, model_runner_output(left_out, []))
    assert retry.status == RequestStatus.PREEMPTED
    resumed = scheduler.schedule()
    assert resumed.num_scheduled_tokens == {retry.request_id: 32}
    assert num_hit_tokens(scheduler, retry) == 48  # its own, not yet written
    scheduler.finish_requests(retry.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(retried, model_runner_output(retried, []))
    assert num_hit_tokens(scheduler, retry) == 32  # 48 before this fix
    scheduler.update_from_output(resumed, model_runner_output(resumed, []))
    assert num_hit_tokens(scheduler, retry) == 32
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0


def test_retry_preempted_before_the_report_has_its_output_dropped():
    """As above, but vLLM itself preempts the retry (priority) in the step
    dispatched after it, before the aborted request's step reports. The retry
    is no longer running, and vLLM delivers a preempted request's output in
    flight by default: that output is dropped instead, as it was computed over
    KV nobody wrote."""
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        block_size=BLOCK_SIZE,
        async_scheduling=True,
        scheduling_policy="priority",
        long_prefill_token_threshold=64,
        num_blocks=10,
    )
    aborted, retry = create_requests_with_priority(
        num_requests=2, priorities=[1, 1], num_tokens=64, same_prompt=True
    )
    [urgent] = create_requests_with_priority(
        num_requests=1, priorities=[0], num_tokens=128, starting_idx=2
    )
    scheduler.add_request(aborted)
    in_flight = scheduler.schedule()
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(retry)
    scheduler.add_request(urgent)
    retried = scheduler.schedule()
    assert retried.num_scheduled_tokens == {
        urgent.request_id: 64,
        retry.request_id: 16,
    }
    # The urgent request's next chunk needs the retry's blocks.
    scheduler.schedule()
    assert retry.status == RequestStatus.PREEMPTED
    assert retry.num_stale_output_tokens == 16

    scheduler.update_from_output(in_flight, model_runner_output(in_flight, []))
    assert retry.drop_stale_output  # delivered before this fix
    output = create_model_runner_output([urgent, retry])
    output.sampled_token_ids[0] = []  # the urgent request's prefill chunk
    outputs = scheduler.update_from_output(retried, output)
    assert not any(output.outputs for output in outputs.values())
    assert retry.num_output_tokens == 0


def test_reader_of_a_state_left_out_through_its_copy_recomputes():
    """A computes a 200-token prompt. D, its first 176 tokens, runs two chunks:
    128 tokens, then 32 more with a checkpoint of its state at 160 in the block
    it computes, and is aborted meanwhile. R, A's first 176 tokens then its own,
    is admitted on a hit of 160 tokens; its step first copies D's checkpoint
    into R's own block, so no block R holds is one whose state was left out.
    The output of D's second chunk leaves D out: R read a state nobody wrote
    through the copy, and is preempted to recompute from D's state at 128."""
    scheduler = create_mamba_scheduler()
    prompt = list(range(1000, 1200))
    a = create_mamba_request("A", prompt, max_tokens=1)
    scheduler.add_request(a)
    while scheduler.get_num_unfinished_requests():
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(
            scheduler_output, model_runner_output(scheduler_output, [a])
        )
    d = create_mamba_request("D", prompt[:176], max_tokens=5)
    r = create_mamba_request("R", prompt[:176] + list(range(6000, 6030)), max_tokens=3)
    scheduler.add_request(d)
    first_chunk = scheduler.schedule()
    left_out = scheduler.schedule()
    assert left_out.num_scheduled_tokens == {d.request_id: 32}
    scheduler.finish_requests(d.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(first_chunk, model_runner_output(first_chunk, [d]))
    scheduler.add_request(r)
    copying = scheduler.schedule()
    [admitted] = copying.scheduled_new_reqs
    assert admitted.num_computed_tokens == 160
    [copy] = copying.kv_cache_block_copies
    state_block_ids = admitted.block_ids[1]
    assert copy.dst_block_id in state_block_ids
    assert copy.src_block_id not in state_block_ids

    scheduler.update_from_output(left_out, model_runner_output(left_out, [r]))
    assert r.status == RequestStatus.PREEMPTED  # RUNNING without the copy
    assert r.num_computed_tokens == 0
    assert num_hit_tokens(scheduler, r) == 128
    outputs = scheduler.update_from_output(copying, model_runner_output(copying, [r]))
    assert not any(output.outputs for output in outputs.values())
    resumed = scheduler.schedule().scheduled_cached_reqs
    assert resumed.resumed_req_ids == {r.request_id}
    assert resumed.num_computed_tokens == [128]


def test_reader_of_a_block_rewritten_since_its_stale_entry_keeps_running():
    """X's 48 tokens are dispatched beside D's chunk to 160 (D's state at 160
    checkpointed in the block D computes), and X is aborted while they run; the
    pool is full, so X's blocks are the next ones handed out. D's next chunk
    would overwrite its checkpoint: vLLM copies it into one of X's blocks and
    moves its key there. R is admitted on a partial hit of D's 160 tokens,
    through a copy of that block. The output of X's step leaves X out, and X's
    entries go; the one on that block was stale (the block was reused), and R
    read D's checkpoint, written and copied since, not KV X never wrote: R keeps
    running (the rollback's first form took any copy from a block an entry was
    removed from as a bad read, and preempted R)."""
    scheduler = create_mamba_scheduler(num_blocks=18)
    prompt = list(range(1000, 1176))
    d = create_mamba_request("D", prompt, max_tokens=1)
    x = create_mamba_request("X", list(range(3000, 3064)), max_tokens=1)
    r = create_mamba_request("R", prompt[:160] + list(range(6000, 6020)), max_tokens=2)
    scheduler.add_request(d)
    first_chunk = scheduler.schedule()
    scheduler.add_request(x)
    left_out = scheduler.schedule()
    assert left_out.num_scheduled_tokens == {d.request_id: 32, x.request_id: 48}
    [x_admitted] = left_out.scheduled_new_reqs
    x_block_ids = {b for group in x_admitted.block_ids for b in group}
    scheduler.finish_requests(x.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(first_chunk, model_runner_output(first_chunk, [d]))
    moving = scheduler.schedule()
    [moved] = moving.kv_cache_block_copies
    assert moved.dst_block_id in x_block_ids
    scheduler.add_request(r)
    copying = scheduler.schedule()
    [admitted] = copying.scheduled_new_reqs
    assert admitted.num_computed_tokens == 160
    [copy] = copying.kv_cache_block_copies
    assert copy.src_block_id == moved.dst_block_id

    scheduler.update_from_output(left_out, model_runner_output(left_out, [d]))
    # X's state checkpoint at 48, never written, is no longer cached.
    block_pool = scheduler.kv_cache_manager.block_pool
    [x_state_block_id] = x_admitted.block_ids[1]
    assert block_pool.blocks[x_state_block_id].block_hash is None
    assert r.status == RequestStatus.RUNNING  # PREEMPTED by the first form
    assert r.num_computed_tokens == 176


def test_request_preempted_for_a_left_out_one_keeps_its_state():
    """A and B compute their first chunks in one step. In the next, A's second
    chunk needs blocks: B, the later arrival, is preempted, and A takes over
    B's attention blocks. A is aborted with both steps in flight and its
    output leaves it out. A's entries of the second step, on B's former
    blocks, go with the first step's report; B is no loader of A's: its state
    at 64, which the first step wrote in a block nobody took over, stays
    cached (the rollback's first form took every request of the reporting step
    with an entry on one of those blocks for a loader)."""
    scheduler = create_mamba_scheduler(num_blocks=12, reserve_full_isl=False)
    a = create_mamba_request("A", list(range(1000, 1256)), max_tokens=1)
    b = create_mamba_request("B", list(range(2000, 2080)), max_tokens=4)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first_chunks = scheduler.schedule()
    assert first_chunks.num_scheduled_tokens == {a.request_id: 64, b.request_id: 64}
    [_, b_admitted] = first_chunks.scheduled_new_reqs
    [b_state_block_id] = b_admitted.block_ids[1]
    taking_over = scheduler.schedule()
    assert taking_over.num_scheduled_tokens == {a.request_id: 64}
    assert b.status == RequestStatus.PREEMPTED
    a_block_ids = {
        block_id
        for group in scheduler.kv_cache_manager.get_block_ids(a.request_id)
        for block_id in group
    }
    assert set(b_admitted.block_ids[0]) & a_block_ids
    assert b_state_block_id not in a_block_ids

    scheduler.finish_requests(a.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(first_chunks, model_runner_output(first_chunks, [b]))
    assert num_hit_tokens(scheduler, a) == 0  # A's chunks were never written
    block_pool = scheduler.kv_cache_manager.block_pool
    assert block_pool.blocks[b_state_block_id].block_hash is not None  # None before
    scheduler.update_from_output(taking_over, model_runner_output(taking_over, []))
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0
