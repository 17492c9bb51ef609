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
`test_uncommitted_prefix_cache.py`).
"""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

# A worker's output listing the step's requests among those given (none: all left out).
from .test_uncommitted_prefix_cache import model_runner_output, num_hit_tokens
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
