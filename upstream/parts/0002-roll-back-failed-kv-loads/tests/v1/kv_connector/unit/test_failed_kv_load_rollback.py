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

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from .utils import create_mock_connector, create_scheduler, create_vllm_config

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
SAMPLED_TOKEN = 7


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 4,
    priority: int = 0,
    arrival_time: float = 0.0,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        priority=priority,
        arrival_time=arrival_time,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )


def make_output(
    scheduler: Scheduler,
    scheduler_output: SchedulerOutput,
    invalid_block_ids: set[int] | None = None,
) -> ModelRunnerOutput:
    """What the model runner returns for a step: a token for every request that
    finished its prefill, none for a prefill chunk."""
    req_ids = list(scheduler_output.num_scheduled_tokens)
    sampled_token_ids: list[list[int]] = []
    for req_id in req_ids:
        request = scheduler.requests.get(req_id)
        prefill_chunk = request is None or request.is_prefill_chunk
        sampled_token_ids.append([] if prefill_chunk else [SAMPLED_TOKEN])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={req_id: i for i, req_id in enumerate(req_ids)},
        sampled_token_ids=sampled_token_ids,
        kv_connector_output=(
            KVConnectorOutput(invalid_block_ids=invalid_block_ids)
            if invalid_block_ids
            else None
        ),
    )


def run_step(scheduler: Scheduler) -> SchedulerOutput:
    """One synchronous engine step."""
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(
        scheduler_output, make_output(scheduler, scheduler_output)
    )
    return scheduler_output


def num_hit_tokens(scheduler: Scheduler, prompt_token_ids: list[int]) -> int:
    """Tokens a new request with this prompt would find in the prefix cache."""
    probe = make_request("probe", prompt_token_ids)
    return scheduler.kv_cache_manager.get_computed_blocks(probe)[1]


def running_ids(scheduler: Scheduler) -> list[str]:
    return [request.request_id for request in scheduler.running]


# KV-connector loads that fail (#19330, #26813). The loader gets its first three
# blocks from the connector synchronously: `allocate_slots` registers them in the
# step that loads them, before the load ran.
PROMPT = list(range(1, 65))
NUM_LOADED_TOKENS = 48


def create_loading_scheduler(
    policy: str, async_scheduling: bool = False, max_num_batched_tokens: int = 64
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
    scheduler.connector.get_num_new_matched_tokens.side_effect = match_loader_tokens
    scheduler.connector.request_finished.return_value = (False, None)
    scheduler.connector.take_events.return_value = ()
    return scheduler


def match_loader_tokens(request: Request, num_computed_tokens: int):
    if request.request_id == "loader" and num_computed_tokens == 0:
        return NUM_LOADED_TOKENS, False
    return 0, False


def loaded_block_ids(scheduler: Scheduler) -> set[int]:
    block_ids = scheduler.kv_cache_manager.get_block_ids("loader")
    return {block_id for group in block_ids for block_id in group[:3]}


def finish_all(scheduler: Scheduler, max_steps: int = 50) -> None:
    for _ in range(max_steps):
        if not scheduler.get_num_unfinished_requests():
            return
        run_step(scheduler)
    raise AssertionError("requests did not finish")


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_failed_load_of_aborted_loader_is_never_hit(policy: str):
    """#19330: the loader is aborted while its failing step runs; vLLM no longer
    finds it among the requests holding the invalid blocks, so their entries
    stayed, under either policy."""
    scheduler = create_loading_scheduler(policy)
    scheduler.add_request(make_request("loader", PROMPT))
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"loader": 16}
    invalid_block_ids = loaded_block_ids(scheduler)
    scheduler.finish_requests("loader", RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(
        scheduler_output,
        make_output(scheduler, scheduler_output, invalid_block_ids),
    )
    assert num_hit_tokens(scheduler, PROMPT) == 0


def test_failed_load_under_recompute_is_never_hit():
    """#26813: under `recompute` the loader is rewound and recomputes its blocks
    later; until then their entries named KV that never arrived."""
    scheduler = create_loading_scheduler("recompute")
    scheduler.add_request(make_request("loader", PROMPT))
    scheduler_output = scheduler.schedule()
    invalid_block_ids = loaded_block_ids(scheduler)
    scheduler.update_from_output(
        scheduler_output,
        make_output(scheduler, scheduler_output, invalid_block_ids),
    )
    assert num_hit_tokens(scheduler, PROMPT) == 0
    finish_all(scheduler)
    # Recomputed, the blocks are cached again.
    assert num_hit_tokens(scheduler, PROMPT + [0] * BLOCK_SIZE) == 64


def test_sharer_of_failed_load_recomputes():
    """#26813: a sharer hits the blocks the loader registers in the same step, and
    the load fails. vLLM truncates only the first holder of an invalid block; the sharer
    would keep it as computed. It is preempted to recompute instead, and the
    invalid blocks' entries go (see test_sync_load_failure_with_shared_blocks).
    Under `fail`, vLLM fails every holder of an invalid block already."""
    scheduler = create_loading_scheduler("recompute")
    scheduler.add_request(make_request("loader", PROMPT))
    scheduler.add_request(make_request("sharer", PROMPT))
    scheduler_output = scheduler.schedule()
    assert scheduler_output.num_scheduled_tokens == {"loader": 16, "sharer": 16}
    invalid_block_ids = loaded_block_ids(scheduler)
    sharer = scheduler.requests["sharer"]
    scheduler.update_from_output(
        scheduler_output,
        make_output(scheduler, scheduler_output, invalid_block_ids),
    )
    assert running_ids(scheduler) == ["loader"]
    assert sharer.status == RequestStatus.PREEMPTED
    assert sharer.num_computed_tokens == 0
    assert num_hit_tokens(scheduler, PROMPT) == 0


def test_failed_load_removes_entries_of_later_steps_in_flight():
    """#26813, async: two steps in flight; the step after the failing one already
    computed (and registered) more of the loader's prompt on top of the invalid KV."""
    scheduler = create_loading_scheduler(
        "recompute", async_scheduling=True, max_num_batched_tokens=32
    )
    prompt = list(range(1, 97))
    scheduler.add_request(make_request("loader", prompt))
    failing = scheduler.schedule()
    following = scheduler.schedule()
    assert following.num_scheduled_tokens == {"loader": 16}
    invalid_block_ids = loaded_block_ids(scheduler)
    scheduler.update_from_output(
        failing, make_output(scheduler, failing, invalid_block_ids)
    )
    assert num_hit_tokens(scheduler, prompt) == 0
    scheduler.update_from_output(following, make_output(scheduler, following))
    assert num_hit_tokens(scheduler, prompt) == 0


def test_reader_admitted_on_failed_load_recomputes():
    """#26813, async: a request admitted in the next step on a hit of the
    loaded blocks reads KV whose load then fails; it recomputes, and nothing it
    computed over that KV stays cached."""
    scheduler = create_loading_scheduler("recompute", async_scheduling=True)
    scheduler.add_request(make_request("loader", PROMPT))
    failing = scheduler.schedule()
    scheduler.add_request(make_request("reader", PROMPT + list(range(500, 532))))
    following = scheduler.schedule()
    [admitted] = following.scheduled_new_reqs
    assert admitted.req_id == "reader"
    assert admitted.num_computed_tokens >= NUM_LOADED_TOKENS  # A hit on the load.
    reader = scheduler.requests["reader"]
    invalid_block_ids = loaded_block_ids(scheduler)
    scheduler.update_from_output(
        failing, make_output(scheduler, failing, invalid_block_ids)
    )
    assert "reader" not in running_ids(scheduler)
    assert reader.status == RequestStatus.PREEMPTED
    scheduler.update_from_output(following, make_output(scheduler, following))
    assert num_hit_tokens(scheduler, PROMPT + list(range(500, 532))) == 0
