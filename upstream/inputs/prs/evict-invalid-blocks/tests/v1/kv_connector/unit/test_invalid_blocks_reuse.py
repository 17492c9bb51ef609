# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""No request reuses KV computed over a block whose load failed: the invalid
blocks and those after them leave the prefix cache under either failure
policy, every request holding one recomputes it, and output computed over it
in flight is dropped."""

import pytest

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from .utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

NUM_PROMPT_BLOCKS = 4
NUM_LOADED_BLOCKS = 3
INVALID_BLOCK_IDX = 1


def _make_scheduler(policy: str, async_scheduling: bool = False) -> Scheduler:
    vllm_config = create_vllm_config(kv_load_failure_policy=policy)
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    scheduler = create_scheduler(vllm_config)
    scheduler.connector = create_mock_connector()
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler


def _prompt(scheduler: Scheduler) -> Request:
    """A prompt whose first `NUM_LOADED_BLOCKS` blocks every such prompt shares."""
    num_tokens = NUM_PROMPT_BLOCKS * scheduler.block_size
    return create_request(
        num_tokens=num_tokens,
        common_prefix_len=NUM_LOADED_BLOCKS * scheduler.block_size,
    )


def _load_with_failure(scheduler: Scheduler) -> Request:
    """Add a prompt whose shared blocks a sync load fills (the connector
    matches them for it alone)."""
    loader = _prompt(scheduler)
    scheduler.add_request(loader)
    num_loaded_tokens = NUM_LOADED_BLOCKS * scheduler.block_size
    scheduler.connector.get_num_new_matched_tokens.side_effect = lambda r, _: (
        (num_loaded_tokens, False) if r is loader else (0, False)
    )
    return loader


def _num_hit_tokens(scheduler: Scheduler) -> int:
    """Prefix-cache hit of a new prompt sharing the loaded blocks."""
    _, num_hit_tokens, _ = scheduler.kv_cache_manager.get_computed_blocks(
        _prompt(scheduler)
    )
    return num_hit_tokens


def test_invalid_blocks_not_hit_until_recomputed():
    """Policy recompute: the failed block and those after it leave the prefix
    cache (as under policy fail) until the loader recomputes them."""
    scheduler = _make_scheduler("recompute")
    loader = _load_with_failure(scheduler)
    scheduler_output = scheduler.schedule()
    block_ids = scheduler_output.scheduled_new_reqs[0].block_ids[0]
    assert _num_hit_tokens(scheduler) == NUM_LOADED_BLOCKS * scheduler.block_size

    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output(
            [loader], invalid_block_ids={block_ids[INVALID_BLOCK_IDX]}
        ),
    )
    assert loader.num_computed_tokens == INVALID_BLOCK_IDX * scheduler.block_size
    assert _num_hit_tokens(scheduler) == INVALID_BLOCK_IDX * scheduler.block_size

    # The loader recomputes from the failed block and caches it again.
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(scheduler_output, create_model_runner_output([loader]))
    assert _num_hit_tokens(scheduler) == NUM_LOADED_BLOCKS * scheduler.block_size


def test_blocks_of_loader_finished_in_flight_evicted():
    """Async scheduling: the loader is aborted while its step runs; its blocks
    wait for that step, and the failure reported with it still evicts them."""
    scheduler = _make_scheduler("fail", async_scheduling=True)
    loader = _load_with_failure(scheduler)
    scheduler_output = scheduler.schedule()
    block_ids = scheduler_output.scheduled_new_reqs[0].block_ids[0]
    scheduler.finish_requests(loader.request_id, RequestStatus.FINISHED_ABORTED)

    scheduler.update_from_output(
        scheduler_output,
        create_model_runner_output(
            [loader], invalid_block_ids={block_ids[INVALID_BLOCK_IDX]}
        ),
    )
    assert _num_hit_tokens(scheduler) == INVALID_BLOCK_IDX * scheduler.block_size


def test_output_in_flight_over_invalid_block_dropped():
    """Async scheduling: the step after the load is dispatched before the
    failure is reported; its output, computed over the failed block, is
    dropped and the loader recomputes from that block."""
    scheduler = _make_scheduler("recompute", async_scheduling=True)
    loader = _load_with_failure(scheduler)
    load_step = scheduler.schedule()
    block_ids = load_step.scheduled_new_reqs[0].block_ids[0]
    next_step = scheduler.schedule()
    assert next_step.num_scheduled_tokens == {loader.request_id: 1}

    scheduler.update_from_output(
        load_step,
        create_model_runner_output(
            [loader], invalid_block_ids={block_ids[INVALID_BLOCK_IDX]}
        ),
    )
    scheduler.update_from_output(next_step, create_model_runner_output([loader]))
    assert loader.num_output_tokens == 0
    assert loader.num_computed_tokens == INVALID_BLOCK_IDX * scheduler.block_size
