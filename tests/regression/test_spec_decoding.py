"""Speculative decoding on a hybrid model in align mode, judged by the shadow-KV oracle.

vLLM never registers draft tokens (``allocate_slots`` caches up to ``request.num_tokens``,
which excludes them); a rejection only lowers ``num_computed_tokens``. A decode step whose
accepted drafts cross a state-block boundary leaves the state at that boundary in its
block (the runner's align-mode postprocess), and vLLM 0.33 (0.32's ``AsyncScheduler``
too) registers it in ``update_from_output``, once the step ran; 0.32's ``Scheduler``
registers it in the next ``allocate_slots``. Under async scheduling the next step is
scheduled as if every draft were accepted, and the runner moves it back by the drafts
the step in flight rejects.

Here a request decodes across boundaries with three drafts a step, and a second one
whose prompt is the first's prompt and output resumes from a boundary state that only a
drafted step wrote: the hit is right, stock and guard. The oracle has teeth: without the
boundary copy, or (async) without the runner's move back, it sees wrong state.

Last, the soak's stock finding with an EAGLE drafter, shrunk: the priority-preemption
zombie on the prompt checkpoint EAGLE moves one block back (vLLM 0.30-0.32).
"""

from __future__ import annotations

import dataclasses

import pytest

from layouts import HYBRID_WRONG_STATE_0_33
from vllm_prefix_guard_harness.factory import (
    hash_lookahead_tokens,
    make_request,
    make_scheduler,
)
from vllm_prefix_guard_harness.fuzz.configs import ALL_CONFIGS
from vllm_prefix_guard_harness.fuzz.differential import run_seed
from vllm_prefix_guard_harness.fuzz.runner import run_workload
from vllm_prefix_guard_harness.fuzz.workload import Arrive, Workload
from vllm_prefix_guard_harness.shadow_kv import (
    STATE_NEVER_WRITTEN,
    STATE_WRONG_CONTENT,
    Driver,
    ShadowState,
    TokenModel,
)

PROMPT = list(range(1, 101))  # 100 tokens; the state blocks hold 16
DECODED = 60


def continuation(prompt: list[int], num_tokens: int) -> list[int]:
    """The fake model's first ``num_tokens`` tokens after ``prompt`` (what a request
    with that prompt generates)."""
    model = TokenModel(prompt)
    return [model.token(position) for position in range(len(prompt), len(prompt) + num_tokens)]


def drafted_then_resumed(async_scheduling: bool, drafter: str = "ngram") -> Driver:
    """r0 decodes 60 tokens with three drafts a step; then r1, whose prompt is r0's
    prompt and first 40 generated tokens, is admitted on a hit of r0's blocks."""
    scheduler = make_scheduler(
        num_blocks=64,
        mamba_align=True,
        num_speculative_tokens=3,
        drafter=drafter,
        async_scheduling=async_scheduling,
    )
    lookahead = hash_lookahead_tokens(scheduler)
    driver = Driver(scheduler, depth=2 if async_scheduling else 1)
    driver.add(make_request("r0", PROMPT, max_tokens=DECODED, hash_lookahead_tokens=lookahead))
    driver.run()
    prompt = [*PROMPT, *continuation(PROMPT, 40), 999]
    driver.add(make_request("r1", prompt, max_tokens=4, hash_lookahead_tokens=lookahead))
    driver.run()
    return driver


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_hit_on_a_boundary_state_left_by_accepted_drafts_is_right(
    mode: str, async_scheduling: bool, drafter: str
) -> None:
    """With either drafter (EAGLE: lookahead slots, and the hit's last block dropped or
    each block hashed with the token after it), r1's hit resumes from a state r0's
    drafted decode left, and nothing read is bad."""
    driver = drafted_then_resumed(async_scheduling, drafter)
    (state,) = driver.worker.states
    assert state.boundary_copies > 0  # drafts crossed boundaries and were accepted
    assert state.resumed_from_hits > 0
    # r1 resumed past r0's prompt: from a state r0 left while decoding.
    assert driver.hit_tokens > len(PROMPT) // 16 * 16
    assert driver.violations == 0, dict(driver.kv.counts)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_oracle_sees_a_boundary_state_no_drafted_step_copied(
    monkeypatch: pytest.MonkeyPatch, async_scheduling: bool
) -> None:
    """Teeth: a runner that leaves the boundary's block alone leaves r1's hit on a
    state that was never written there."""
    put = ShadowState._put

    def put_but_boundary_copies(self: ShadowState, block_id, read, tokens, poison, step) -> None:  # type: ignore[no-untyped-def]
        if tokens == read.valid_end:  # the step's own state, not a boundary's copy
            put(self, block_id, read, tokens, poison, step)

    monkeypatch.setattr(ShadowState, "_put", put_but_boundary_copies)
    driver = drafted_then_resumed(async_scheduling)
    assert driver.kv.counts[STATE_WRONG_CONTENT] > 0 or driver.kv.counts[STATE_NEVER_WRITTEN]


def test_the_oracle_follows_the_runner_moving_a_step_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth, async: positions taken as scheduled (every draft of the step in flight
    counted as accepted) write KV and state where the runner does not."""
    schedule = Driver.schedule

    def schedule_without_move_back(self: Driver):  # type: ignore[no-untyped-def]
        output = schedule(self)
        for read in self.in_flight[-1].reads:
            read.earlier = []
        return output

    monkeypatch.setattr(Driver, "schedule", schedule_without_move_back)
    driver = drafted_then_resumed(async_scheduling=True)
    assert driver.violations > 0


#: The soak's EAGLE configurations this test runs on one seed each, and whether stock reads
#: bad KV there (the attention zombie of ``victim-async``; the hybrid ones on CI's seeds
#: read nothing bad on stock).
EAGLE_IN_CI = {"eagle-victim-async": True, "hybrid-eagle-retry-async": False}


@pytest.mark.parametrize("name", EAGLE_IN_CI)
def test_eagle_configurations_read_nothing_bad_under_the_guard(name: str) -> None:
    """CI's representative of the soak's EAGLE configurations (``eagle-victim-async``,
    ``hybrid-eagle-victim``, ``hybrid-eagle-retry-async`` and their ``-sparse`` variants):
    seed 0 of two, stock and guard, with the audit."""
    runs = run_seed(ALL_CONFIGS[name], 0, ("stock", "guard"))
    assert (runs["stock"].violations > 0) == EAGLE_IN_CI[name]
    guard = runs["guard"]
    assert guard.violations == 0, guard.examples[:5]
    assert guard.audit is not None
    assert (guard.audit.valid_rolled_back, guard.audit.invalid_committed) == (0, 0)


#: The soak's stock finding on ``hybrid-eagle-retry-async`` (vLLM 0.32, seed 0 at the soak's
#: horizon), shrunk. With an EAGLE drafter, vLLM 0.30-0.32 drop a prefix hit's last block, so
#: the state a prompt leaves for later hits sits one block further back
#: (``get_mamba_prefill_checkpoint_position``): for r4's 226-token prompt at 208, and
#: ``_mamba_block_aligned_split`` ends a prefill chunk there. In iteration 7 r4 (priority 1)
#: is given its chunk to 208, its state block registered for the 208-token hash at
#: allocation (block 4, r0's old checkpoint, evicted), then preempted in the same
#: ``schedule()`` for r5 (its twin, priority 0): the entry outlives the free. r5's own
#: chunk to 208 registers a second block under that key; r4 resumes at iteration 8 on the
#: first, a state block nobody wrote since r0. The state zombie of ``hybrid-victim``,
#: reached here only with the drafter: the same arrivals without it read nothing bad.
EAGLE_CHECKPOINT_ZOMBIE = Workload(
    spec=dataclasses.replace(
        HYBRID_WRONG_STATE_0_33.spec,
        num_blocks=48,
        async_scheduling=True,
        num_speculative_tokens=2,
        drafter="eagle",
    ),
    depth=2,
    events=(
        Arrive(0, "r0", prompt=((1000, 32), (2000, 16)), max_tokens=3),
        Arrive(0, "r1", prompt=((1000, 32), (3000, 24)), max_tokens=1),
        Arrive(1, "r2", prompt=((1000, 32), (4000, 113), (5000, 74)), max_tokens=4, priority=1),
        Arrive(1, "r3", prompt=((1000, 32), (6000, 85)), max_tokens=6),
        Arrive(2, "r4", prompt=((1000, 32), (7000, 194)), max_tokens=1, priority=1),
        Arrive(6, "r5", prompt=((1000, 32), (7000, 194)), max_tokens=1),
    ),
)


def test_no_resume_from_a_zombie_checkpoint_an_eagle_drafter_moved_back(mode: str) -> None:
    """Stock resumes r4 from a state block nobody wrote (vLLM 0.30-0.32, whose EAGLE hits
    drop their last block; 0.33 hashes each block with the token after it instead, and
    schedules these arrivals otherwise); the guard rolls the entry back with the
    preemption and r4 recomputes."""
    result = run_workload(EAGLE_CHECKPOINT_ZOMBIE, "stock" if mode == "native" else mode)
    if mode != "stock":
        assert result.violations == 0, result.examples[:5]
        return
    if hash_lookahead_tokens(make_scheduler(EAGLE_CHECKPOINT_ZOMBIE.spec)) > 0:
        assert result.violations == 0, result.examples[:5]
        return
    assert (result.violations, result.bad_state_reads) == (1, 1)
    assert result.examples == [(8, "r4", 208, 4, STATE_WRONG_CONTENT)]


@pytest.mark.parametrize("drafts", [0, 2])
def test_the_eagle_checkpoint_zombie_needs_the_eagle_drafter(drafts: int) -> None:
    """The same arrivals without a drafter, or with two n-gram drafts a step (lookahead
    slots, no dropped block): the prompt's checkpoint is its last full block, the schedule
    differs, and stock reads nothing bad."""
    spec = dataclasses.replace(
        EAGLE_CHECKPOINT_ZOMBIE.spec, num_speculative_tokens=drafts, drafter="ngram"
    )
    workload = dataclasses.replace(EAGLE_CHECKPOINT_ZOMBIE, spec=spec)
    assert run_workload(workload, "stock").violations == 0
