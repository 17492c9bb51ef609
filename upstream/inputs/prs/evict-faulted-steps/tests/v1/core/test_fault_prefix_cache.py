# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""When every request is finished at once (fault tolerance's `on_fault`), the
steps in flight never come back: the blocks cached for their tokens leave the
prefix cache, those of the steps that came back stay."""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from ..kv_connector.unit.utils import create_model_runner_output
from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
CHUNK = 2 * BLOCK_SIZE


def _num_hit_tokens(scheduler: Scheduler, request: Request) -> int:
    _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(request)
    return num_hit_tokens


@pytest.mark.parametrize("num_steps_back", [0, 1])
def test_blocks_of_steps_in_flight_evicted_when_every_request_finishes(
    num_steps_back: int,
):
    scheduler = create_scheduler(
        enable_prefix_caching=True,
        max_num_batched_tokens=CHUNK,
        block_size=BLOCK_SIZE,
        async_scheduling=True,
    )
    request, retry = create_requests(
        num_requests=2, num_tokens=3 * CHUNK, same_prompt=True
    )
    scheduler.add_request(request)
    # Two chunks in flight, each caching its two blocks when scheduled.
    steps = [scheduler.schedule(), scheduler.schedule()]
    assert _num_hit_tokens(scheduler, retry) == 2 * CHUNK
    for step in steps[:num_steps_back]:
        scheduler.update_from_output(step, create_model_runner_output([request]))

    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)

    assert _num_hit_tokens(scheduler, retry) == num_steps_back * CHUNK
