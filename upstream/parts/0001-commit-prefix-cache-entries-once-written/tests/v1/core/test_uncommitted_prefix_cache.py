# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries registered for KV a step has not written yet.

`allocate_slots` registers the blocks a step is about to compute. These tests pin
that such an entry is removed when its KV will never be written (the request is
preempted inside the same `schedule()`, the step's output never comes back, the
prefix cache is reset), and kept otherwise (steps in flight, same-step sharing,
an abort while the step runs). vLLM issues and PRs: #43569 (eager registration
outliving `free()`), #56525 (async retry of an aborted prefill).
"""

import pytest

from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus

from ..kv_connector.unit.utils import make_kv_cache_config
from .utils import create_scheduler

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


def num_tokens_written(request_id: str, outputs: list[SchedulerOutput]) -> int:
    """Tokens of a request that dispatched steps compute, in whole blocks."""
    num_tokens = sum(o.num_scheduled_tokens.get(request_id, 0) for o in outputs)
    return num_tokens // BLOCK_SIZE * BLOCK_SIZE


# Priority preemption of a request already scheduled in the same `schedule()`:
# D and A run; B (higher priority than A) arrives; in the next step A is scheduled
# first and registers its next blocks, then B cannot allocate and preempts A.
PROMPT_A = list(range(1, 161))
PROMPT_B = list(range(2000, 2120))
PROMPT_D = list(range(1000, 1016))


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
    # Admit a request when its next chunk fits, as the notes' layout needs.
    scheduler.scheduler_reserve_full_isl = False
    return scheduler


def test_preempted_request_leaves_no_entry_of_its_step():
    """#43569: A is preempted after `allocate_slots` registered its next block;
    that block is never written, so no later request may hit it."""
    scheduler = create_priority_scheduler()
    scheduler.add_request(make_request("D", PROMPT_D, max_tokens=3))
    scheduler.add_request(make_request("A", PROMPT_A, priority=1))
    outputs = [run_step(scheduler)]
    scheduler.add_request(make_request("B", PROMPT_B))
    outputs.append(run_step(scheduler))
    preempting = scheduler.schedule()
    assert preempting.preempted_req_ids == {"A"}
    assert "A" not in preempting.num_scheduled_tokens

    # A's two dispatched chunks wrote 128 tokens; its third chunk never runs.
    assert num_tokens_written("A", outputs) == 128
    assert num_hit_tokens(scheduler, PROMPT_A) == 128


def test_preempted_request_in_hybrid_model_leaves_no_entry():
    """#43569, hybrid: full attention plus sliding window. The victim's entries of
    the step being scheduled go in every KV cache group."""
    base = create_priority_scheduler()
    scheduler = Scheduler(
        vllm_config=base.vllm_config,
        kv_cache_config=make_kv_cache_config(
            BLOCK_SIZE, swa_enabled=True, sw_size=32, num_blocks=32
        ),
        block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=base.structured_output_manager,
    )
    scheduler.scheduler_reserve_full_isl = False
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    scheduler.add_request(make_request("D", PROMPT_D, max_tokens=3))
    scheduler.add_request(make_request("A", PROMPT_A, priority=1))
    outputs = [run_step(scheduler)]
    scheduler.add_request(make_request("B", PROMPT_B))
    outputs.append(run_step(scheduler))
    assert scheduler.schedule().preempted_req_ids == {"A"}

    assert num_tokens_written("A", outputs) == 128
    assert num_hit_tokens(scheduler, PROMPT_A) == 128


def test_preemption_keeps_entries_of_steps_in_flight():
    """#43569 (its in-flight rollback): async scheduling, A is preempted while its
    previous chunk is still running. That step cannot be cancelled and writes its
    blocks, so their entries stay (#43569 removes them too, losing valid hits);
    only the entries of the step being scheduled go."""
    scheduler = create_priority_scheduler(num_blocks=28, async_scheduling=True)
    prompt_a = list(range(1, 321))
    scheduler.add_request(make_request("D", PROMPT_D, max_tokens=3))
    scheduler.add_request(make_request("A", prompt_a, priority=1))
    dispatched = [scheduler.schedule()]
    for step in range(8):
        if step == 2:
            scheduler.add_request(make_request("B", PROMPT_B))
        scheduler_output = scheduler.schedule()
        in_flight = dispatched[-1]
        scheduler.update_from_output(in_flight, make_output(scheduler, in_flight))
        if scheduler_output.preempted_req_ids:
            break
        dispatched.append(scheduler_output)
    assert scheduler_output.preempted_req_ids == {"A"}
    # A's last dispatched chunk is still running: 192 tokens written, 64 to come.
    assert num_tokens_written("A", dispatched[:-1]) == 192
    assert num_tokens_written("A", dispatched) == 256

    probe = prompt_a + [0] * BLOCK_SIZE
    assert num_hit_tokens(scheduler, probe) == 256
    for step_output in (dispatched[-1], scheduler_output):
        scheduler.update_from_output(step_output, make_output(scheduler, step_output))
    assert num_hit_tokens(scheduler, probe) == 256


def test_dropped_step_entries_are_removed():
    """#43569 (its FIFO pairing): a step whose output never comes back (the next one
    is committed first, as EngineCore's fault-tolerance drain does) wrote nothing:
    its entries go. The record is keyed by the output, not by a count."""
    scheduler = create_scheduler(enable_prefix_caching=True, block_size=BLOCK_SIZE)
    prompt = list(range(1, 33))
    scheduler.add_request(make_request("a", prompt))
    dropped = scheduler.schedule()
    assert dropped.num_scheduled_tokens == {"a": 32}
    scheduler.add_request(make_request("b", list(range(100, 132))))
    following = scheduler.schedule()
    assert following.num_scheduled_tokens == {"b": 32}
    assert num_hit_tokens(scheduler, prompt) == 16  # Shared in its step; see below.

    scheduler.update_from_output(following, make_output(scheduler, following))
    assert num_hit_tokens(scheduler, prompt) == 0
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0


def test_same_step_sharing_is_kept():
    """#43569 (same-step dependents): identical prompts (and `n>1` children) share
    the blocks their step registers, as prefix caching intends: one forward writes
    them before attention reads them. The patch keeps this (hiding them would cost
    512 + 3 x 512 tokens instead of 512 + 3 x 16)."""
    scheduler = create_scheduler(enable_prefix_caching=True, block_size=BLOCK_SIZE)
    prompt = list(range(1, 513))
    for i in range(4):
        scheduler.add_request(make_request(f"n{i}", prompt))
    scheduler_output = run_step(scheduler)
    assert scheduler_output.num_scheduled_tokens == {
        "n0": 512,
        "n1": 16,
        "n2": 16,
        "n3": 16,
    }
    assert num_hit_tokens(scheduler, prompt + [0]) == 512
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0


def test_abort_while_step_in_flight_keeps_its_entries():
    """#56525's shape: async scheduling, a long prefill is aborted while its step is
    in flight and retried at once. The dispatched step still runs and writes its
    blocks (vLLM's runners compute every request of a dispatched step), so the
    retry hits them and they stay cached: an abort is not a rollback."""
    scheduler = create_scheduler(
        enable_prefix_caching=True, block_size=BLOCK_SIZE, async_scheduling=True
    )
    prompt = list(range(1, 65))
    scheduler.add_request(make_request("a", prompt))
    in_flight = scheduler.schedule()
    scheduler.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(make_request("retry", prompt))
    retried = scheduler.schedule()
    [admitted] = retried.scheduled_new_reqs
    assert admitted.num_computed_tokens == 48
    for step_output in (in_flight, retried):
        scheduler.update_from_output(step_output, make_output(scheduler, step_output))
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0
    assert num_hit_tokens(scheduler, prompt) == 48


def test_reset_prefix_cache_drops_uncommitted_entries():
    """#43569 (test 5, reset): a reset while a step is in flight drops that step's
    record; its late output changes nothing, and the next steps commit as usual."""
    scheduler = create_scheduler(
        enable_prefix_caching=True, block_size=BLOCK_SIZE, async_scheduling=True
    )
    prompt = list(range(1, 65))
    scheduler.add_request(make_request("a", prompt))
    in_flight = scheduler.schedule()
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 1
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0
    assert num_hit_tokens(scheduler, prompt) == 0

    resumed = scheduler.schedule()
    scheduler.update_from_output(in_flight, make_output(scheduler, in_flight))
    scheduler.update_from_output(resumed, make_output(scheduler, resumed))
    assert scheduler.uncommitted_prefix_cache.num_steps_in_flight == 0
    assert num_hit_tokens(scheduler, prompt) == 48
