# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries of KV-connector loads that fail.

`allocate_slots` registers the blocks a KV connector loads synchronously in the
step that loads them, before the load ran. These tests pin that, when the load
fails, no request hits those blocks, nor KV computed over them, and that every
request that counted such KV as computed recomputes it. vLLM issues: #19330 and
#26813 (KV-load failure recovery).
"""

import pytest

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .test_kv_load_failure_recovery import _make_get_num_new_matched_tokens
from .utils import (
    create_mock_connector,
    create_model_runner_output,
    create_request,
    create_scheduler,
    create_vllm_config,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
# The loader gets its first three blocks from the connector synchronously:
# `allocate_slots` registers them in the step that loads them, before the load ran.
NUM_PROMPT_TOKENS = 64
NUM_LOADED_TOKENS = 48


def model_runner_output(
    scheduler_output: SchedulerOutput,
    requests: list[Request],
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    # create_model_runner_output samples even for a prefill chunk; a runner does not.
    scheduled = [
        request
        for request in requests
        if request.request_id in scheduler_output.num_scheduled_tokens
    ]
    output = create_model_runner_output(scheduled, invalid_block_ids=invalid_block_ids)
    output.sampled_token_ids = [
        [] if request.is_prefill_chunk else token_ids
        for request, token_ids in zip(scheduled, output.sampled_token_ids)
    ]
    return output


def num_hit_tokens(
    scheduler: Scheduler, request: Request, max_cache_hit_length: int | None = None
) -> int:
    """Tokens a new request with `request`'s prompt would find in the prefix
    cache (all but its last token at most); with `max_cache_hit_length`, a new
    request whose prompt extends it that far."""
    if max_cache_hit_length is None:
        max_cache_hit_length = request.num_prompt_tokens - 1
    return scheduler.kv_cache_manager.get_computed_blocks(
        request, max_cache_hit_length
    )[1]


def create_loading_scheduler(
    loader: Request,
    policy: str,
    async_scheduling: bool = False,
    max_num_batched_tokens: int = 64,
) -> Scheduler:
    vllm_config = create_vllm_config(
        kv_load_failure_policy=policy,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    vllm_config.scheduler_config.long_prefill_token_threshold = 16
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    scheduler = create_scheduler(vllm_config, num_blocks=100)
    scheduler.connector = create_mock_connector()
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        _make_get_num_new_matched_tokens(
            {loader.request_id: NUM_LOADED_TOKENS}, async_load=False
        )
    )
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler


def loaded_block_ids(scheduler_output: SchedulerOutput, loader: Request) -> set[int]:
    """The blocks the connector loads for the loader in the step that admits it."""
    [block_ids] = [
        new_req.block_ids[0]
        for new_req in scheduler_output.scheduled_new_reqs
        if new_req.req_id == loader.request_id
    ]
    return set(block_ids[: NUM_LOADED_TOKENS // BLOCK_SIZE])


def finish_all(
    scheduler: Scheduler, requests: list[Request], max_steps: int = 50
) -> None:
    for _ in range(max_steps):
        if not scheduler.get_num_unfinished_requests():
            return
        scheduler_output = scheduler.schedule()
        scheduler.update_from_output(
            scheduler_output, model_runner_output(scheduler_output, requests)
        )
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_of_aborted_loader_is_never_hit(policy: str):
    """#19330: the loader is aborted while its failing step runs; vLLM no longer
    finds it among the requests holding the invalid blocks, so their entries
    stayed, under either policy."""
    loader = create_request(
        num_tokens=NUM_PROMPT_TOKENS, common_prefix_len=NUM_PROMPT_TOKENS
    )
    scheduler = create_loading_scheduler(loader, policy)
    scheduler.add_request(loader)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {loader.request_id: 16}
    invalid_block_ids = loaded_block_ids(scheduler_output, loader)
    scheduler.finish_requests(loader.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(
        scheduler_output,
        model_runner_output(scheduler_output, [loader], invalid_block_ids),
    )
    assert num_hit_tokens(scheduler, loader) == 0


def test_failed_load_under_recompute_is_never_hit():
    """#26813: under `recompute` the loader is rewound and recomputes its blocks
    later; until then their entries named KV that never arrived."""
    loader = create_request(
        num_tokens=NUM_PROMPT_TOKENS, common_prefix_len=NUM_PROMPT_TOKENS
    )
    scheduler = create_loading_scheduler(loader, "recompute")
    scheduler.add_request(loader)
    scheduler_output = scheduler.schedule()
    invalid_block_ids = loaded_block_ids(scheduler_output, loader)
    scheduler.update_from_output(
        scheduler_output,
        model_runner_output(scheduler_output, [loader], invalid_block_ids),
    )
    assert num_hit_tokens(scheduler, loader) == 0
    finish_all(scheduler, [loader])
    # Recomputed, the blocks are cached again (a new request whose prompt
    # extends the loader's hits all of it).
    assert num_hit_tokens(scheduler, loader, NUM_PROMPT_TOKENS) == 64


def test_blocks_loaded_after_a_failed_block_stay_cached():
    """Only the load of the loader's second block fails: the third loaded fine and
    keeps its entry (a sharer that hits the recomputed second block hits it too).
    The loader caches its recomputed blocks around it, registering none twice."""
    loader = create_request(
        num_tokens=NUM_PROMPT_TOKENS, common_prefix_len=NUM_PROMPT_TOKENS
    )
    scheduler = create_loading_scheduler(loader, "recompute")
    scheduler.add_request(loader)
    scheduler_output = scheduler.schedule()
    [block_ids] = scheduler_output.scheduled_new_reqs[0].block_ids
    failed, loaded_fine = block_ids[1], block_ids[2]
    scheduler.update_from_output(
        scheduler_output,
        model_runner_output(scheduler_output, [loader], {failed}),
    )
    block_pool = scheduler.kv_cache_manager.block_pool
    assert block_pool.blocks[failed].block_hash is None
    assert block_pool.blocks[loaded_fine].block_hash is not None
    # A hit stops at the failed block until the loader has recomputed it.
    assert num_hit_tokens(scheduler, loader) == BLOCK_SIZE
    finish_all(scheduler, [loader])
    assert num_hit_tokens(scheduler, loader, NUM_PROMPT_TOKENS) == NUM_PROMPT_TOKENS


def test_sharer_of_failed_load_recomputes():
    """#26813: a sharer hits the blocks the loader registers in the same step, and
    the load fails. vLLM truncates only the first holder of an invalid block; the sharer
    would keep it as computed. It is preempted to recompute instead, and the
    invalid blocks' entries go (see test_sync_load_failure_with_shared_blocks).
    Under `fail`, vLLM fails every holder of an invalid block already."""
    requests = loader, sharer = [
        create_request(
            num_tokens=NUM_PROMPT_TOKENS, common_prefix_len=NUM_PROMPT_TOKENS
        )
        for _ in range(2)
    ]
    scheduler = create_loading_scheduler(loader, "recompute")
    scheduler.add_request(loader)
    scheduler.add_request(sharer)
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {
        loader.request_id: 16,
        sharer.request_id: 16,
    }
    invalid_block_ids = loaded_block_ids(scheduler_output, loader)
    scheduler.update_from_output(
        scheduler_output,
        model_runner_output(scheduler_output, requests, invalid_block_ids),
    )
    assert scheduler.running == [loader]
    assert sharer.status == RequestStatus.PREEMPTED
    assert sharer.num_computed_tokens == 0
    assert num_hit_tokens(scheduler, loader) == 0


def test_failed_load_removes_entries_of_later_steps_in_flight():
    """#26813, async: two steps in flight; the step after the failing one already
    computed (and registered) more of the loader's prompt on top of the invalid KV."""
    loader = create_request(num_tokens=96)
    scheduler = create_loading_scheduler(
        loader, "recompute", async_scheduling=True, max_num_batched_tokens=32
    )
    scheduler.add_request(loader)
    failing = scheduler.schedule()
    following = scheduler.schedule()
    assert following.num_scheduled_tokens == {loader.request_id: 16}
    invalid_block_ids = loaded_block_ids(failing, loader)
    scheduler.update_from_output(
        failing, model_runner_output(failing, [loader], invalid_block_ids)
    )
    assert num_hit_tokens(scheduler, loader) == 0
    scheduler.update_from_output(following, model_runner_output(following, [loader]))
    assert num_hit_tokens(scheduler, loader) == 0


def test_reader_admitted_on_failed_load_recomputes():
    """#26813, async: a request admitted in the next step on a hit of the
    loaded blocks reads KV whose load then fails; it recomputes, and nothing it
    computed over that KV stays cached."""
    loader = create_request(
        num_tokens=NUM_PROMPT_TOKENS, common_prefix_len=NUM_PROMPT_TOKENS
    )
    # The loader's prompt, then 32 tokens of its own.
    reader = create_request(
        num_tokens=NUM_PROMPT_TOKENS + 32, common_prefix_len=NUM_PROMPT_TOKENS
    )
    requests = [loader, reader]
    scheduler = create_loading_scheduler(loader, "recompute", async_scheduling=True)
    scheduler.add_request(loader)
    failing = scheduler.schedule()
    scheduler.add_request(reader)
    following = scheduler.schedule()
    [admitted] = following.scheduled_new_reqs
    assert admitted.req_id == reader.request_id
    assert admitted.num_computed_tokens >= NUM_LOADED_TOKENS  # A hit on the load.
    invalid_block_ids = loaded_block_ids(failing, loader)
    scheduler.update_from_output(
        failing, model_runner_output(failing, requests, invalid_block_ids)
    )
    assert reader not in scheduler.running
    assert reader.status == RequestStatus.PREEMPTED
    scheduler.update_from_output(following, model_runner_output(following, requests))
    assert num_hit_tokens(scheduler, reader) == 0


def test_loader_resumed_on_its_own_failed_load_recomputes():
    """#26813, async: a reset of the running requests preempts the loader while the
    step of its load is in flight, then fails to reset the cache (its blocks are in
    use), and the loader resumes at once on a hit of its own loaded blocks. When the
    load fails, vLLM truncates the loader, but the token its resuming step sampled
    over the failed KV would still reach the client; it is preempted to recompute,
    with that output dropped."""
    loader = create_request(num_tokens=NUM_PROMPT_TOKENS, max_tokens=4)
    scheduler = create_loading_scheduler(loader, "recompute", async_scheduling=True)
    scheduler.add_request(loader)
    failing = scheduler.schedule()
    # As a connector does: only what the prefix cache does not hold.
    scheduler.connector.get_num_new_matched_tokens.side_effect = (
        lambda request, num_computed_tokens: (
            max(0, NUM_LOADED_TOKENS - num_computed_tokens),
            False,
        )
    )
    with pytest.raises(RuntimeError, match="Failed to reset KV cache"):
        scheduler.reset_prefix_cache(reset_running_requests=True)
    assert loader.status == RequestStatus.PREEMPTED
    resuming = scheduler.schedule()
    assert loader.request_id in resuming.scheduled_cached_reqs.resumed_req_ids
    assert num_hit_tokens(scheduler, loader) >= NUM_LOADED_TOKENS  # Its own load.
    invalid_block_ids = loaded_block_ids(failing, loader)
    scheduler.update_from_output(
        failing, model_runner_output(failing, [loader], invalid_block_ids)
    )
    assert loader.status == RequestStatus.PREEMPTED
    outputs = scheduler.update_from_output(
        resuming, model_runner_output(resuming, [loader])
    )
    delivered = [
        output.new_token_ids
        for client_outputs in outputs.values()
        for output in client_outputs.outputs
        if output.request_id == loader.request_id
    ]
    assert not any(delivered)
    assert num_hit_tokens(scheduler, loader) == 0
