"""The oracle's state groups: a hybrid model's recurrent state per block, in align mode.

The scheduler is vLLM's own with a full-attention group and a Mamba group in ``align``
mode (``SchedulerSpec(mamba_align=True)``); the shadow worker keeps, per state block, which
prefix's state it holds, and checks the state every step starts from (a prefix hit
resumes from the block registered for the hit). These tests pin that the oracle follows
state through valid hits without a false alarm, and that it sees a resume from a state
that was never written or holds another prefix's (the priority-preemption zombie on a
state block), both ways.
"""

from __future__ import annotations

from functools import wraps
from typing import Any

import pytest
import vllm

from guard_demo import hybrid_engine_proof
from layouts import (
    HYBRID_PARTIAL_ZOMBIE_STATE,
    HYBRID_SPARSE_ZOMBIE_CHECKPOINT,
    HYBRID_WRONG_STATE_0_33,
)
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.fuzz.capabilities import partial_state_hits_unsound
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.oracle import MeteredDriver
from vllm_prefix_guard_harness.fuzz.runner import RunResult, run_workload
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Workload, expand
from vllm_prefix_guard_harness.shadow_kv import STATE_NEVER_WRITTEN, STATE_WRONG_CONTENT, Driver

PROMPT = list(range(1, 161))  # ten 16-token blocks: prefilled in 64-token chunks


def retried_abort() -> Driver:
    """A's first 64 tokens are dispatched (its state for 64 registered), A is aborted
    while that step is in flight and retried at once with the same prompt."""
    scheduler = make_scheduler(
        num_blocks=64, mamba_align=True, async_scheduling=True, max_num_batched_tokens=64
    )
    driver = Driver(scheduler, depth=2)
    driver.add(make_request("A", PROMPT, max_tokens=4))
    driver.schedule()
    driver.abort("A", at_once=True)
    driver.add(make_request("A-retry", PROMPT, max_tokens=4))
    driver.run()
    return driver


def test_state_follows_valid_hits(mode: str) -> None:
    """Shared prefixes on one request after another: every resume from a hit is checked
    and right, both ways."""
    scheduler = make_scheduler(num_blocks=64, mamba_align=True, long_prefill_token_threshold=64)
    driver = Driver(scheduler)
    for i in range(6):
        driver.add(make_request(f"r{i}", [*PROMPT[: 48 + 16 * (i % 4)], 500 + i], max_tokens=20))
        for _ in range(3):
            driver.step()
    driver.run()
    (state,) = driver.worker.states
    assert driver.violations == 0, dict(driver.kv.counts)
    assert state.resumed_from_hits >= 4 and driver.hit_tokens > 0


def test_retry_of_an_aborted_prefill_resumes_from_its_state(mode: str) -> None:
    """vLLM's runners compute the aborted request's dispatched step: the retry's hit on
    its state is valid."""
    driver = retried_abort()
    assert driver.hit_tokens > 0 and driver.worker.states[0].resumed_from_hits > 0
    assert driver.violations == 0, dict(driver.kv.counts)


def cached_states_not_held(driver: Driver, expected: dict[Any, int]) -> int:
    """State-group blocks cached under a prefix (one of ``expected``: block hash -> the
    fingerprint of the prefix it names) whose block does not hold that prefix's state."""
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id

    (state,) = driver.worker.states
    wrong = 0
    for block in driver.scheduler.kv_cache_manager.block_pool.blocks:
        key = block.block_hash
        if key is None or get_group_id(key) != state.group:
            continue
        fingerprint = expected.get(get_block_hash(key))
        wrong += fingerprint is not None and state.held.get(block.block_id) != fingerprint
    return wrong


def steps_with_wrong_state_cached(seed: int) -> int:
    """Run ``hybrid-victim``'s workload of ``seed`` (300 iterations of arrivals) as the
    fuzzer does; count the steps after which, with nothing in flight, a state block is
    cached under a prefix whose state it does not hold."""
    workload = CONFIGS["hybrid-victim"].workload(seed=seed, horizon=300)
    size = workload.spec.block_size
    driver = MeteredDriver(make_scheduler(workload.spec), workload.depth)
    expected: dict[Any, int] = {}
    pending = list(workload.events)
    steps = iteration = arrivals = 0
    while pending or driver.scheduler.has_requests():
        while pending and pending[0].step <= iteration:
            event = pending.pop(0)
            if isinstance(event, Arrive):
                arrivals += 1
                request = make_request(
                    event.request_id,
                    expand(event.prompt),
                    size,
                    event.max_tokens,
                    event.priority,
                    arrival_time=float(arrivals),  # as the fuzzer's runs
                )
                driver.add(request)
            elif isinstance(event, Abort):
                driver.abort(event.request_id)
        driver.step()
        iteration += 1
        for request_id, model in driver.worker.models.items():
            request = driver.scheduler.requests.get(request_id)
            for k, block_hash in enumerate(request.block_hashes if request else ()):
                expected.setdefault(block_hash, model.fingerprint((k + 1) * size - 1))
        steps += cached_states_not_held(driver, expected) > 0
    assert driver.violations == 0, dict(driver.kv.counts)
    return steps


def test_preemption_leaves_no_never_written_state_cached(mode: str) -> None:
    """Priority preemption inside ``schedule()`` (``hybrid-victim``'s episodes, seeds
    0-5): the victim's withdrawn chunk registered its state for the chunk end and the step
    never ran. Stock keeps that entry cached on some seeds (which ones depends on the vLLM
    release's scheduling; no read reaches it: the preemptor evicts the victim's last
    full-attention block first, so a hybrid hit stops short, see docs/fuzzing.md); the
    guard rolls it back on every seed."""
    per_seed = [steps_with_wrong_state_cached(seed) for seed in range(6)]
    if mode == "stock":
        assert any(per_seed), per_seed
    else:
        assert not any(per_seed), per_seed


def test_no_resume_from_a_wrong_state(mode: str) -> None:
    """The 0.33 soak's stock finding on ``hybrid-victim``'s episodes, shrunk: the
    priority-preemption zombie on a state block. Step 110 registers r26's state after 160
    tokens on block 18 and preempts r26 in the same ``schedule()``; r26 recomputes the chunk
    into block 39 under the same key; r27 (its n>1 twin) hits 160 tokens and vLLM's index
    returns block 18 first, never written. Stock vLLM 0.33 reads it; the guard reads no
    wrong state. On other releases the shrunk schedule need not reach the window, so
    stock's side is asserted where it does."""
    result = run_workload(HYBRID_WRONG_STATE_0_33, "stock" if mode == "native" else mode)
    if mode == "stock":
        if not result.bad_state_reads:
            pytest.skip("this shrunk schedule reaches the window on vLLM 0.33's scheduler only")
        assert any(kind == STATE_WRONG_CONTENT for *_, kind in result.examples)
    else:
        assert result.violations == 0, result.examples[:5]


def run_partial_state_layout(workload: Workload, mode: str) -> RunResult:
    """``workload`` (a state block of several attention blocks: partial state hits) run in
    ``mode``, skipped where this vLLM copies partial-hit checkpoints wrong itself; on a vLLM
    with its own fix (``native``), its stock run."""
    reason = partial_state_hits_unsound()
    if reason is not None:
        pytest.skip(reason)
    return run_workload(workload, "stock" if mode == "native" else mode)


def test_no_resume_from_an_own_zombie_state_block(mode: str) -> None:
    """The fuzzer's stock finding on ``hybrid-partial-kv-load-async`` (vLLM 0.33 seed 5,
    0.32 seed 4), shrunk: the priority-preemption zombie on a state block that spans four
    attention blocks. The preempted request resumes on the entry its own preemption left,
    and starts from the state a previous tenant left in the block. Stock vLLM 0.32 and
    0.33 read it; the guard rolls the entry back with the preemption. Where this vLLM's
    partial state hits are unsound (``capabilities``), the shrunk schedule is not
    judged."""
    result = run_partial_state_layout(HYBRID_PARTIAL_ZOMBIE_STATE, mode)
    if mode == "stock":
        _, request_id, position, _, kind = result.examples[0]
        assert (request_id, position, kind) == ("r11", 192, STATE_WRONG_CONTENT)
    else:
        assert result.violations == 0, result.examples[:5]


def test_no_resume_from_an_own_zombie_checkpoint_under_default_retention(mode: str) -> None:
    """The fuzzer's stock finding on ``hybrid-partial-victim-sparse`` (vLLM 0.32 seed 1),
    shrunk: under an engine's default prefix-cache retention (interval 0) a prompt leaves
    only its checkpoint's state cached, and the priority-preemption zombie lands there. r1
    is given its chunk to its checkpoint (272 tokens), the checkpoint registered, and r1
    preempted in the same ``schedule()``; resumed, it starts from its own entry, a block
    holding another request's state. Stock vLLM 0.32 and 0.33 read it (with every state
    retained the schedule reads nothing bad); the guard rolls the entry back with the
    preemption."""
    result = run_partial_state_layout(HYBRID_SPARSE_ZOMBIE_CHECKPOINT, mode)
    if mode == "stock":
        assert result.examples == [(7, "r1", 272, 7, STATE_WRONG_CONTENT)]
    else:
        assert result.violations == 0, result.examples[:5]


def test_engine_sized_zombie_checkpoint_under_default_retention(mode: str) -> None:
    """The layout ``tests/e2e/test_engine_hybrid_zombie.py`` runs on a real engine
    (``guard_demo.hybrid_engine_proof``: 64-token blocks, one state block per attention
    block, vLLM's default retention), through the shadow-KV oracle. r3 is preempted in the
    ``schedule()`` call that gave it its chunk to its prompt's checkpoint (256 tokens) and
    resumes on that entry in the next: stock starts it from a state block nobody wrote
    (vLLM 0.31-0.33; 0.30 schedules these arrivals otherwise and reads nothing bad); the
    guard rolls the entry back with the preemption."""
    result = run_workload(hybrid_engine_proof.LAYOUT, "stock" if mode == "native" else mode)
    if mode == "stock":
        if vllm.__version__.startswith("0.30."):
            assert result.violations == 0
            return
        assert result.examples[0] == (6, "r3", 256, 15, STATE_NEVER_WRITTEN), result.examples[:3]
    else:
        assert result.violations == 0, result.examples[:5]


def retired_boundary(filler: bool) -> tuple[Driver, int]:
    """vLLM PR #57253's shape, async: P (a 70-token prompt) decodes on, and align mode
    retires its state after 64 tokens (P's next pass does not need it; the block goes back
    to the pool keeping its entry). With ``filler``, Q's prompt then needs the pool and
    reclaims that block, and the entry goes with the reuse. R, P's prompt then its own,
    arrives while P still runs: P's attention KV is there, held. Returns the driver and
    R's prefix-cache hit."""
    scheduler = make_scheduler(
        num_blocks=20, mamba_align=True, async_scheduling=True, long_prefill_token_threshold=64
    )
    driver = Driver(scheduler, depth=2)
    prompt = list(range(1000, 1070))
    driver.add(make_request("P", prompt, max_tokens=60))
    for step in range(30):
        if step == 12 and filler:
            driver.add(make_request("Q", list(range(5000, 5150)), max_tokens=2))
        driver.step()
    hits_before = driver.hit_tokens
    driver.add(make_request("R", [*prompt, *range(9000, 9010)], max_tokens=2))
    driver.run()
    return driver, driver.hit_tokens - hits_before


def test_a_retired_boundary_state_costs_hits_not_correctness(mode: str) -> None:
    """#57253 reports lost hits: once the pool reuses the retired block, R's prefix has
    attention KV but no state to resume from, and R computes it (64 hit tokens without
    the filler, none with it). Stock and guard alike: the pool drops the entry when it
    reuses the block, so no request resumes from the state Q wrote there."""
    for filler, hit in ((False, 64), (True, 0)):
        driver, hit_tokens = retired_boundary(filler)
        assert hit_tokens == hit
        assert driver.violations == 0, dict(driver.kv.counts)


def test_a_block_copy_carries_the_state_it_holds() -> None:
    """vLLM 0.33's runner copies a Mamba partial hit's block (copy-on-write,
    ``SchedulerOutput.kv_cache_block_copies``) before the forward pass: the copy holds what
    the source held, and a copy of a never-written block holds nothing the oracle trusts."""
    from vllm_prefix_guard_harness.shadow_kv import ShadowState

    state = ShadowState(group=1, block_size=4, held={3: 111}, written_at={3: 7})
    state.copy(3, 5)
    assert (state.held[5], state.written_at[5]) == (111, 7)
    state.held[6] = 222
    state.copy(4, 6)
    assert 6 not in state.held


def test_states_published_after_the_output_are_judged_both_ways(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM 0.34 also calls ``cache_blocks`` from ``update_from_output`` on a hybrid model
    under sync scheduling ("publish finalized states"), with no step open: the guard takes
    what it registers as written (that step's output is back). ``hybrid-victim`` seed 0
    reaches that call in both modes, and neither reads a bad state there (where the
    release has no such call, nothing is reached and the test says so)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    calls = {"inside": False, "count": 0}
    update, cache_blocks = Scheduler.update_from_output, KVCacheManager.cache_blocks

    def counting_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["inside"] = True
        try:
            return update(self, *args, **kwargs)
        finally:
            calls["inside"] = False

    def counting_cache_blocks(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls["count"] += calls["inside"]
        return cache_blocks(self, *args, **kwargs)

    monkeypatch.setattr(Scheduler, "update_from_output", wraps(update)(counting_update))
    monkeypatch.setattr(KVCacheManager, "cache_blocks", wraps(cache_blocks)(counting_cache_blocks))
    workload = CONFIGS["hybrid-victim"].workload(0)
    for mode in ("stock", "guard"):
        calls["count"] = 0
        result = run_workload(workload, mode)
        if not calls["count"]:
            pytest.skip("this vLLM publishes no state from update_from_output when sync")
        assert result.bad_state_reads == result.violations == 0, (mode, result)
