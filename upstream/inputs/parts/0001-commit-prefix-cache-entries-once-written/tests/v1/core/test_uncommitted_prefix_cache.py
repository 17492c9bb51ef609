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
import torch

from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from ..kv_connector.unit.utils import create_model_runner_output, make_kv_cache_config
from ..kv_connector.unit.utils import (
    create_scheduler as create_scheduler_with_kv_cache_config,
)
from .test_scheduler import create_requests_with_priority
from .utils import create_requests, create_scheduler

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16


def model_runner_output(
    scheduler_output: SchedulerOutput, requests: list[Request]
) -> ModelRunnerOutput:
    # create_model_runner_output samples even for a prefill chunk; a runner does not.
    scheduled = [
        request
        for request in requests
        if request.request_id in scheduler_output.num_scheduled_tokens
    ]
    output = create_model_runner_output(scheduled)
    output.sampled_token_ids = [
        [] if request.is_prefill_chunk else token_ids
        for request, token_ids in zip(scheduled, output.sampled_token_ids)
    ]
    return output


def run_step(scheduler: Scheduler, requests: list[Request]) -> SchedulerOutput:
    """One synchronous engine step."""
    scheduler_output = scheduler.schedule()
    scheduler.update_from_output(
        scheduler_output, model_runner_output(scheduler_output, requests)
    )
    return scheduler_output


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


def num_tokens_written(request: Request, outputs: list[SchedulerOutput]) -> int:
    """Tokens of a request that dispatched steps compute, in whole blocks."""
    req_id = request.request_id
    num_tokens = sum(o.num_scheduled_tokens.get(req_id, 0) for o in outputs)
    return num_tokens // BLOCK_SIZE * BLOCK_SIZE


# A hybrid model's state block spans four attention blocks.
STATE_BLOCK_SIZE = 64


def create_mamba_scheduler(
    num_blocks: int = 64,
    *,
    async_scheduling: bool = True,
    scheduling_policy: str = "fcfs",
    reserve_full_isl: bool = True,
    retention_interval: int | None = None,
) -> Scheduler:
    """Full attention plus a Mamba group in align mode, as a GPU engine builds
    it (the scheduler steps in state blocks and hashes in attention blocks).
    Without `reserve_full_isl`, a request is admitted on the blocks of its
    first chunk. `retention_interval` is the engine's
    `--prefix-cache-retention-interval` (0 by default: only a prompt's
    checkpoint keeps its state; None: every state block boundary)."""
    vllm_config = VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", dtype="float16", seed=42),
        scheduler_config=SchedulerConfig(
            max_num_seqs=16,
            max_num_batched_tokens=256,
            max_model_len=1024,
            long_prefill_token_threshold=64,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
            policy=scheduling_policy,
            scheduler_reserve_full_isl=reserve_full_isl,
        ),
        cache_config=CacheConfig(
            block_size=STATE_BLOCK_SIZE,
            enable_prefix_caching=True,
            mamba_cache_mode="align",
            mamba_block_size=STATE_BLOCK_SIZE,
            prefix_cache_retention_interval=retention_interval,
        ),
    )
    # A platform without async scheduling turns it off in the config.
    vllm_config.scheduler_config.async_scheduling = async_scheduling
    kv_cache_config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attention"],
                FullAttentionSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=1,
                    head_size=1,
                    dtype=torch.float32,
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(
                    block_size=STATE_BLOCK_SIZE,
                    shapes=((1, 1),),
                    dtypes=(torch.float32,),
                    mamba_cache_mode="align",
                ),
            ),
        ],
        # As an engine passes its cache config's (get_kv_cache_config).
        prefix_cache_retention_interval=retention_interval,
    )
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    scheduler_class = AsyncScheduler if async_scheduling else Scheduler
    return scheduler_class(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        block_size=STATE_BLOCK_SIZE,
        hash_block_size=BLOCK_SIZE,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
    )


def create_mamba_request(
    request_id: str, prompt: list[int], max_tokens: int, priority: int = 0
) -> Request:
    init_none_hash(sha256)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        priority=priority,
    )


# Priority preemption of a request already scheduled in the same `schedule()`:
# D and A run; B (higher priority than A) arrives; in the next step A is scheduled
# first and registers its next blocks, then B cannot allocate and preempts A.
def create_priority_requests(num_tokens_a: int = 160) -> list[Request]:
    """D (16 tokens, 3 to generate) and B (120 tokens) at priority 0, A at
    priority 1 (lower); each with a prompt of its own."""
    [d] = create_requests_with_priority(
        num_requests=1, priorities=[0], num_tokens=16, max_tokens=3, req_ids=["D"]
    )
    [a] = create_requests_with_priority(
        num_requests=1,
        priorities=[1],
        num_tokens=num_tokens_a,
        starting_idx=1,
        req_ids=["A"],
    )
    [b] = create_requests_with_priority(
        num_requests=1, priorities=[0], num_tokens=120, starting_idx=2, req_ids=["B"]
    )
    return [d, a, b]


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
    # Admit a request when its next chunk fits, as this layout needs.
    scheduler.scheduler_reserve_full_isl = False
    return scheduler


def test_preempted_request_leaves_no_entry_of_its_step():
    """#43569: A is preempted after `allocate_slots` registered its next block;
    that block is never written, so no later request may hit it."""
    scheduler = create_priority_scheduler()  # 20 blocks of 16, 64-token chunks
    requests = d, a, b = create_priority_requests()  # A: 160 tokens
    scheduler.add_request(d)
    scheduler.add_request(a)
    outputs = [run_step(scheduler, requests)]  # A: tokens 0-63
    scheduler.add_request(b)
    outputs.append(run_step(scheduler, requests))  # A: tokens 64-127
    preempting = scheduler.schedule()  # A registers 128-143, then B preempts it
    assert preempting.preempted_req_ids == {a.request_id}
    assert a.request_id not in preempting.num_scheduled_tokens

    # A's two dispatched chunks wrote 128 tokens; its third chunk never runs.
    assert num_tokens_written(a, outputs) == 128
    assert num_hit_tokens(scheduler, a) == 128  # 144 before this fix


def test_preempted_request_in_hybrid_model_leaves_no_entry():
    """#43569, hybrid: full attention plus sliding window. The victim's entries of
    the step being scheduled go in every KV cache group."""
    scheduler = create_scheduler_with_kv_cache_config(
        create_priority_scheduler().vllm_config,
        num_blocks=32,
        kv_cache_config=make_kv_cache_config(
            BLOCK_SIZE, swa_enabled=True, sw_size=32, num_blocks=32
        ),
    )
    scheduler.scheduler_reserve_full_isl = False
    assert len(scheduler.kv_cache_config.kv_cache_groups) == 2
    requests = d, a, b = create_priority_requests()
    scheduler.add_request(d)
    scheduler.add_request(a)
    outputs = [run_step(scheduler, requests)]
    scheduler.add_request(b)
    outputs.append(run_step(scheduler, requests))
    assert scheduler.schedule().preempted_req_ids == {a.request_id}

    assert num_tokens_written(a, outputs) == 128
    assert num_hit_tokens(scheduler, a) == 128


def test_preemption_keeps_entries_of_steps_in_flight():
    """#43569 (its in-flight rollback): async scheduling, A is preempted while its
    previous chunk is still running. That step cannot be cancelled and writes its
    blocks, so their entries stay (#43569 removes them too, losing valid hits);
    only the entries of the step being scheduled go."""
    scheduler = create_priority_scheduler(num_blocks=28, async_scheduling=True)
    requests = d, a, b = create_priority_requests(num_tokens_a=320)
    scheduler.add_request(d)
    scheduler.add_request(a)
    dispatched = [scheduler.schedule()]
    for step in range(8):
        if step == 2:
            scheduler.add_request(b)
        scheduler_output = scheduler.schedule()
        in_flight = dispatched[-1]
        scheduler.update_from_output(
            in_flight, model_runner_output(in_flight, requests)
        )
        if scheduler_output.preempted_req_ids:
            break
        dispatched.append(scheduler_output)
    assert scheduler_output.preempted_req_ids == {a.request_id}
    # A's last dispatched chunk is still running: 192 tokens written, 64 to come.
    assert num_tokens_written(a, dispatched[:-1]) == 192
    assert num_tokens_written(a, dispatched) == 256

    # A new request whose prompt extends A's.
    assert num_hit_tokens(scheduler, a, a.num_prompt_tokens) == 256
    for step_output in (dispatched[-1], scheduler_output):
        scheduler.update_from_output(
            step_output, model_runner_output(step_output, requests)
        )
    assert num_hit_tokens(scheduler, a, a.num_prompt_tokens) == 256


def test_dropped_step_entries_are_removed():
    """#43569 (its FIFO pairing): a step whose output never comes back (the next one
    is committed first, as EngineCore's fault-tolerance drain does) wrote nothing:
    its entries go. The record is keyed by the output, not by a count."""
    scheduler = create_scheduler(enable_prefix_caching=True, block_size=BLOCK_SIZE)
    requests = a, b = create_requests(num_requests=2, num_tokens=32)
    scheduler.add_request(a)
    dropped = scheduler.schedule()
    assert dropped.num_scheduled_tokens == {a.request_id: 32}
    scheduler.add_request(b)
    following = scheduler.schedule()
    assert following.num_scheduled_tokens == {b.request_id: 32}
    assert num_hit_tokens(scheduler, a) == 16  # Shared in its step; see below.

    scheduler.update_from_output(following, model_runner_output(following, requests))
    assert num_hit_tokens(scheduler, a) == 0
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0


def test_steps_in_flight_go_when_every_request_is_finished():
    """Fault tolerance (`--enable-fault-tolerance`): after a fault in the engine
    loop every request is finished at once and the step in flight never comes
    back; the first request after recovery must not hit its blocks."""
    scheduler = create_scheduler(
        enable_prefix_caching=True, block_size=BLOCK_SIZE, async_scheduling=True
    )
    [a] = create_requests(num_requests=1, num_tokens=33)
    scheduler.add_request(a)
    assert scheduler.schedule().num_scheduled_tokens == {a.request_id: 33}
    scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
    assert num_hit_tokens(scheduler, a) == 0
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0


def test_same_step_sharing_is_kept():
    """#43569 (same-step dependents): identical prompts (and `n>1` children) share
    the blocks their step registers, as prefix caching intends: one forward writes
    them before attention reads them. The patch keeps this (hiding them would cost
    512 + 3 x 512 tokens instead of 512 + 3 x 16)."""
    scheduler = create_scheduler(enable_prefix_caching=True, block_size=BLOCK_SIZE)
    requests = create_requests(num_requests=4, num_tokens=512, same_prompt=True)
    for request in requests:
        scheduler.add_request(request)
    scheduler_output = run_step(scheduler, requests)
    assert scheduler_output.num_scheduled_tokens == {
        request.request_id: num_tokens
        for request, num_tokens in zip(requests, (512, 16, 16, 16))
    }
    # A new request whose prompt extends theirs.
    assert num_hit_tokens(scheduler, requests[0], 512) == 512
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0


def test_abort_while_step_in_flight_keeps_its_entries():
    """#56525's shape: async scheduling, a long prefill is aborted while its step is
    in flight and retried at once. The dispatched step still runs and writes its
    blocks (vLLM's runners compute every request of a dispatched step), so the
    retry hits them and they stay cached: an abort is not a rollback."""
    scheduler = create_scheduler(
        enable_prefix_caching=True, block_size=BLOCK_SIZE, async_scheduling=True
    )
    requests = aborted, retry = create_requests(
        num_requests=2, num_tokens=64, same_prompt=True
    )
    scheduler.add_request(aborted)
    in_flight = scheduler.schedule()
    scheduler.finish_requests(aborted.request_id, RequestStatus.FINISHED_ABORTED)
    scheduler.add_request(retry)
    retried = scheduler.schedule()
    [admitted] = retried.scheduled_new_reqs
    assert admitted.num_computed_tokens == 48
    for step_output in (in_flight, retried):
        scheduler.update_from_output(
            step_output, model_runner_output(step_output, requests)
        )
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0
    assert num_hit_tokens(scheduler, retry) == 48


def test_reset_prefix_cache_drops_uncommitted_entries():
    """#43569 (test 5, reset): a reset while a step is in flight drops that step's
    record; its late output changes nothing, and the next steps commit as usual."""
    scheduler = create_scheduler(
        enable_prefix_caching=True, block_size=BLOCK_SIZE, async_scheduling=True
    )
    requests = create_requests(num_requests=1, num_tokens=64)
    [request] = requests
    scheduler.add_request(request)
    in_flight = scheduler.schedule()
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 1
    assert scheduler.reset_prefix_cache(reset_running_requests=True)
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0
    assert num_hit_tokens(scheduler, request) == 0

    resumed = scheduler.schedule()
    scheduler.update_from_output(in_flight, model_runner_output(in_flight, requests))
    scheduler.update_from_output(resumed, model_runner_output(resumed, requests))
    assert len(scheduler.uncommitted_prefix_cache.step_id_to_entries) == 0
    assert num_hit_tokens(scheduler, request) == 48


def test_preempted_request_resumes_from_no_state_checkpoint_of_its_step():
    """A hybrid model with an engine's default prefix-cache retention: a
    prompt's recurrent state is cached at its checkpoint only. A's chunk ends
    on its prompt's checkpoint (272 tokens, inside a state block); that state
    is registered, and A is preempted in the same `schedule()` while B, A's
    prompt at a higher priority, is scheduled there. Nothing writes that
    state, and its block holds another request's (state blocks are not
    zeroed). B reaches the checkpoint two steps later and writes it; A,
    resumed on a partial hit at 272, must copy B's state, not its own entry's
    block."""
    scheduler = create_mamba_scheduler(
        num_blocks=40,
        async_scheduling=False,
        scheduling_policy="priority",
        reserve_full_isl=False,
        retention_interval=0,
    )
    system = list(range(1000, 1064))
    c = create_mamba_request("C", system + list(range(2000, 2023)), max_tokens=4)
    a_prompt = system + list(range(3000, 3213))
    a = create_mamba_request("A", a_prompt, max_tokens=1, priority=2)
    d = create_mamba_request("D", system, max_tokens=5)
    b = create_mamba_request("B", a_prompt, max_tokens=1, priority=1)
    requests = [c, a, d, b]
    scheduler.add_request(c)
    scheduler.add_request(a)
    run_step(scheduler, requests)
    scheduler.add_request(d)
    run_step(scheduler, requests)
    scheduler.add_request(b)
    run_step(scheduler, requests)
    run_step(scheduler, requests)
    assert a.num_computed_tokens == 256
    preempting = run_step(scheduler, requests)  # A registers 272, then goes
    assert preempting.preempted_req_ids == {a.request_id}
    assert b.request_id in preempting.num_scheduled_tokens
    assert run_step(scheduler, requests).num_scheduled_tokens[b.request_id] == 16
    # B's next step would overwrite its checkpoint: vLLM moves it onto a copy.
    [moved] = run_step(scheduler, requests).kv_cache_block_copies

    resuming = scheduler.schedule()
    assert resuming.scheduled_cached_reqs.resumed_req_ids == {a.request_id}
    assert resuming.scheduled_cached_reqs.num_computed_tokens == [272]
    [copy] = resuming.kv_cache_block_copies
    assert copy.src_block_id == moved.dst_block_id  # A's own block before this fix
