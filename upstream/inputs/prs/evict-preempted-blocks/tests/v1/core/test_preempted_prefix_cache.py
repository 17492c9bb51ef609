# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A request preempted in the `schedule()` that scheduled it leaves no
prefix-cache entry for the tokens that step was to compute (#43569)."""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from ..kv_connector.unit.utils import create_scheduler as create_scheduler_for
from ..kv_connector.unit.utils import make_kv_cache_config
from .utils import (
    create_request,
    create_scheduler,
    num_hit_tokens,
    run_step,
    update_step,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


# D and A run; B (higher priority than A) arrives; in the next step A is
# scheduled first and caches its next block, then B cannot allocate and
# preempts A.
def create_priority_requests(num_tokens_a: int = 160) -> list[Request]:
    return [
        create_request("D", [0] * 16, max_tokens=3),
        create_request("A", [1] * num_tokens_a, priority=1),
        create_request("B", [2] * 120),
    ]


def create_priority_scheduler(
    num_blocks: int = 20, async_scheduling: bool = False
) -> Scheduler:
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        scheduling_policy="priority",
        num_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=256,
        long_prefill_token_threshold=64,
        max_model_len=1024,
        async_scheduling=async_scheduling,
    )
    # Admit a request when its next chunk fits, as these tests need.
    scheduler.scheduler_reserve_full_isl = False
    return scheduler


def preempt_a(scheduler: Scheduler) -> list[Request]:
    """Run D and A for two steps (A: tokens 0-127), add B, schedule the step in
    which A caches tokens 128-143 and is then preempted."""
    requests = d, a, b = create_priority_requests()
    scheduler.add_request(d)
    scheduler.add_request(a)
    run_step(scheduler, requests)
    scheduler.add_request(b)
    run_step(scheduler, requests)
    assert scheduler.schedule().preempted_req_ids == {a.request_id}
    return requests


def test_preempted_request_leaves_no_entry_of_its_step():
    scheduler = create_priority_scheduler()
    _, a, _ = preempt_a(scheduler)
    # Its two steps wrote 128 tokens; 144 were cached before this fix.
    assert num_hit_tokens(scheduler, a) == 128


def test_preempted_request_leaves_no_entry_in_any_kv_cache_group():
    """Full attention plus sliding window."""
    scheduler = create_scheduler_for(
        create_priority_scheduler().vllm_config,
        num_blocks=32,
        kv_cache_config=make_kv_cache_config(
            BLOCK_SIZE, swa_enabled=True, sw_size=32, num_blocks=32
        ),
    )
    scheduler.scheduler_reserve_full_isl = False
    _, a, _ = preempt_a(scheduler)
    assert num_hit_tokens(scheduler, a) == 128


def test_preemption_keeps_entries_of_steps_in_flight():
    """Async scheduling: A's previous step is still running when A is
    preempted. It writes its blocks, so their entries stay."""
    scheduler = create_priority_scheduler(num_blocks=28, async_scheduling=True)
    requests = d, a, b = create_priority_requests(num_tokens_a=320)
    scheduler.add_request(d)
    scheduler.add_request(a)
    in_flight = scheduler.schedule()
    for step in range(8):
        if step == 2:
            scheduler.add_request(b)
        scheduler_output = scheduler.schedule()
        if scheduler_output.preempted_req_ids:
            break
        update_step(scheduler, in_flight, requests)
        in_flight = scheduler_output
    assert scheduler_output.preempted_req_ids == {a.request_id}
    num_tokens_dispatched = in_flight.num_scheduled_tokens[a.request_id] + 192
    assert num_hit_tokens(scheduler, a, 320) == num_tokens_dispatched == 256
    update_step(scheduler, in_flight, requests)
    update_step(scheduler, scheduler_output, requests)
    assert num_hit_tokens(scheduler, a, 320) == 256
