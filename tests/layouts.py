"""The scheduler-level layouts more than one test runs: built once, here.

Every test that builds a real scheduler builds it with
:func:`vllm_prefix_guard_harness.factory.make_scheduler`; the layouts below are the
ones two test files share (the regression tests on vLLM's pool, and ``tests/kvcached``
on kvcached's, in its own interpreter, which has this directory on its path). Each
returns the :class:`~vllm_prefix_guard_harness.shadow_kv.Driver` it ran, whose
shadow KV holds the verdict, or the figures the test asserts on; what a test asserts
stays in the test.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_prefix_guard_harness.factory import SchedulerSpec, make_request, make_scheduler
from vllm_prefix_guard_harness.fuzz.workload import Abort, Arrive, Workload
from vllm_prefix_guard_harness.kv_events import KVEventReplay
from vllm_prefix_guard_harness.pool_index import cached_block_ids, keys_cached_twice
from vllm_prefix_guard_harness.shadow_kv import Driver

#: 4 blocks of 16 tokens; the fake connector holds the first 3.
FAILED_LOAD_PROMPT = list(range(1, 65))

#: The scheduler the fuzzer's shrunk async-priority findings run on (``priority-phased-async``,
#: ``everything-async``); a finding adds what it needs (a load-failure policy).
SHRUNK_ASYNC_PRIORITY = SchedulerSpec(
    num_blocks=40,
    max_model_len=4096,
    policy="priority",
    long_prefill_token_threshold=64,
    async_scheduling=True,
)


def shrunk_async_priority(**overrides: Any) -> SchedulerSpec:
    return dataclasses.replace(SHRUNK_ASYNC_PRIORITY, **overrides)


#: The notes' deterministic zombie layout (``notes_zombie.zombie_layout`` of the harness) as the
#: fuzzer's events: D and A run, B arrives, A is preempted in the step that scheduled it,
#: C (and A on resume) hit A's block 8, which A's withdrawn step registered but never wrote.
ZOMBIE_SPEC = SchedulerSpec(num_blocks=20, policy="priority", long_prefill_token_threshold=64)
ZOMBIE_ARRIVALS = (
    Arrive(0, "D", ((1000, 16),), 3),
    Arrive(0, "A", ((1, 160),), 4, priority=1),
    Arrive(1, "B", ((2000, 120),), 4),
    Arrive(3, "C", ((1, 160),), 4, priority=1),
)


def zombie_workload(*more: Any) -> Workload:
    """The zombie layout as a one-step-in-flight workload, with ``more`` events after it."""
    return Workload(ZOMBIE_SPEC, 1, (*ZOMBIE_ARRIVALS, *more))


def failed_sync_load(policy: str, abort_before_update: bool) -> Driver:
    """Request ``r`` loads 48 of its 64 tokens from the connector in one step and the load
    fails (``policy``: vLLM's ``kv_load_failure_policy``), ``r`` optionally aborted while
    that step runs; then ``s``, with the same prompt, arrives and everything runs out."""
    scheduler = make_scheduler(
        num_blocks=40, kv_load_failure_policy=policy, long_prefill_token_threshold=16
    )
    scheduler.connector.external_tokens["r"] = 48
    scheduler.connector.fail_loads.add("r")
    driver = Driver(scheduler)
    driver.add(make_request("r", FAILED_LOAD_PROMPT, max_tokens=4))
    output = driver.schedule()
    assert output.num_scheduled_tokens == {"r": 16}  # 48 tokens come from the connector
    if abort_before_update:
        driver.abort("r")
    driver.complete()
    driver.add(make_request("s", FAILED_LOAD_PROMPT, max_tokens=4))
    driver.run()
    return driver


def loader_two_in_flight() -> tuple[Driver, list[int], Any, Any]:
    """``AsyncScheduler``: ``r`` loads 48 tokens (the load fails) in the first of two steps
    dispatched, the second computing more of its prompt. Returns the driver, ``r``'s prompt
    and the two steps' outputs, neither completed."""
    scheduler = make_scheduler(
        num_blocks=40,
        kv_load_failure_policy="recompute",
        max_num_seqs=4,
        max_num_batched_tokens=32,
        long_prefill_token_threshold=16,
        async_scheduling=True,
    )
    scheduler.connector.external_tokens["r"] = 48
    scheduler.connector.fail_loads.add("r")
    driver = Driver(scheduler, depth=2)
    prompt = list(range(1, 97))
    driver.add(make_request("r", prompt, max_tokens=4))
    return driver, prompt, driver.schedule(), driver.schedule()


def failed_load_two_in_flight() -> tuple[Driver, int]:
    """``AsyncScheduler``, two steps in flight: ``r``'s load fails while the step after it,
    already dispatched, computes (and registers) more of its prompt over the invalid KV;
    then ``s`` with the same prompt. Returns the driver and how many blocks ``r`` computed
    over the invalid KV in the two steps."""
    driver, prompt, failing, following = loader_two_in_flight()
    # Blocks 3-4 (vLLM >= 0.31 lifts long_prefill_token_threshold for a lone request) or
    # block 3 only (vLLM 0.30 caps it), over the invalid prefix; then one more block.
    assert failing.num_scheduled_tokens["r"] in (16, 32)
    assert following.num_scheduled_tokens == {"r": 16}
    computed_blocks = (failing.num_scheduled_tokens["r"] + 16) // 16
    driver.complete()
    driver.add(make_request("s", prompt, max_tokens=4))
    driver.run()
    return driver, computed_blocks


def fcfs_preemption() -> Driver:
    """FCFS on a pool small enough to preempt (never an already-scheduled victim): eight
    requests over one 96-token prefix, sync ``Scheduler``."""
    driver = Driver(
        make_scheduler(num_blocks=24, max_num_batched_tokens=128, long_prefill_token_threshold=48)
    )
    prefix = list(range(1, 97))
    for i in range(8):
        driver.add(make_request(f"r{i}", prefix + [500 + i] * (16 + 8 * i), max_tokens=12))
    driver.run()
    return driver


def fcfs_preemption_two_in_flight() -> Driver:
    """FCFS, ``AsyncScheduler`` with two steps in flight: victims preempted while their
    previous step still executes."""
    scheduler = make_scheduler(
        num_blocks=28,
        max_num_batched_tokens=96,
        long_prefill_token_threshold=32,
        async_scheduling=True,
    )
    driver = Driver(scheduler, depth=2)
    prefix = list(range(1, 65))
    for i in range(10):
        driver.add(make_request(f"r{i}", prefix + [700 + i] * (8 + 8 * i), max_tokens=24))
    driver.run()
    return driver


# -- KV events with one key in two blocks (regression/test_kv_events.py, kvcached's pool) --


def each_consumer_wrong(replay: KVEventReplay) -> tuple[int, int]:
    """Check ``replay`` now; ``(the set consumer's, the counting consumer's)`` keys wrong."""
    before = (replay.missing + replay.extra, replay.counted_missing + replay.counted_extra)
    replay.check()
    after = (replay.missing + replay.extra, replay.counted_missing + replay.counted_extra)
    return after[0] - before[0], after[1] - before[1]


def kv_events_eviction_shape() -> dict[str, Any]:
    """Two greedy-identical requests run to the end, so their second block is one key in
    two free cached blocks; then vLLM evicts one copy (what allocating it for reuse does),
    then the other. Returns, after each eviction, the keys a set consumer and a counting
    consumer replayed from the KV events get wrong (:func:`each_consumer_wrong`), and
    whether the key still hits."""
    scheduler = make_scheduler(num_blocks=40, kv_events=True)
    replay = KVEventReplay(scheduler)
    driver = Driver(scheduler)
    for name in ("x", "y"):
        driver.add(make_request(name, list(range(1, 17)), max_tokens=24))
    driver.run()
    pool = scheduler.kv_cache_manager.block_pool
    index = pool.cached_block_hash_to_block
    key, (first, second) = next(iter(keys_cached_twice(pool).items()))
    before = each_consumer_wrong(replay)
    pool.evict_blocks({first.block_id})
    still_hits = index.get_one_block(key) is second
    after_first = each_consumer_wrong(replay)
    pool.evict_blocks({second.block_id})
    return {
        "pool": type(pool).__name__,
        "events_enabled": KVEventReplay.enabled(scheduler),
        "violations": driver.violations,
        "wrong_before": before,
        "wrong_after_first": after_first,
        "still_hits": still_hits,
        "wrong_after_second": each_consumer_wrong(replay),
        "gone_after_second": index.get_one_block(key) is None,
    }


def kv_events_rollback_shape() -> dict[str, Any]:
    """X and Y decode greedy-identical blocks; W's prefill chunk cannot allocate in the
    step where both register their copy of block 2, and Y (lower priority) is preempted
    after registering its copy, which that step will never write. Found by search over
    pool sizes and arrival steps (9 blocks, W at step 14). Returns how many blocks cache
    the key right after the preemption and the steps after which a consumer replayed from
    the KV events disagreed with the pool."""
    scheduler = make_scheduler(
        num_blocks=9,
        policy="priority",
        long_prefill_token_threshold=32,
        max_num_batched_tokens=256,
        kv_events=True,
    )
    replay = KVEventReplay(scheduler)
    driver = Driver(scheduler)
    prompt = list(range(1, 17))
    driver.add(make_request("X", prompt, max_tokens=40, priority=0, arrival_time=0.0))
    driver.add(make_request("Y", prompt, max_tokens=40, priority=1, arrival_time=1.0))
    manager = scheduler.kv_cache_manager
    index = manager.block_pool.cached_block_hash_to_block
    copies_after_preemption = None
    disagreements = []
    for step in range(400):
        if step == 14:
            driver.add(make_request("W", list(range(500, 564)), max_tokens=4, arrival_time=2.0))
        if not (scheduler.has_requests() or driver.in_flight):
            break
        output = driver.schedule()
        if copies_after_preemption is None and "Y" in (output.preempted_req_ids or ()):
            key = manager.block_pool.blocks[manager.get_block_ids("X")[0][1]].block_hash
            copies_after_preemption = len(cached_block_ids(index).get(key, ()))
        driver.complete()
        if replay.check():
            disagreements.append(step)
    return {
        "pool": type(manager.block_pool).__name__,
        "events_enabled": KVEventReplay.enabled(scheduler),
        "violations": driver.violations,
        "copies_after_preemption": copies_after_preemption,
        "disagreements": disagreements,
    }


#: Shrunk (fuzz shrinker, 900 s) from ``hybrid-victim`` seed 1 at the soak horizon, vLLM 0.33.
HYBRID_WRONG_STATE_0_33 = Workload(
    spec=SchedulerSpec(
        num_blocks=40,
        max_model_len=4096,
        policy="priority",
        long_prefill_token_threshold=64,
        kv_events=True,
        mamba_align=True,
    ),
    depth=1,
    events=(
        Arrive(0, "r0", prompt=((1000, 64), (2000, 140)), max_tokens=7),
        Arrive(3, "r1", prompt=((1000, 64), (3000, 59), (4000, 33)), max_tokens=1, priority=1),
        Arrive(4, "r2", prompt=((1000, 64), (3000, 59), (5000, 45)), max_tokens=22),
        Arrive(9, "r3", prompt=((1000, 64), (3000, 59), (6000, 15)), max_tokens=15),
        Arrive(17, "r4", prompt=((1000, 64), (7000, 71), (8000, 33)), max_tokens=1, priority=2),
        Arrive(18, "r5", prompt=((1000, 64), (9000, 39), (10000, 20)), max_tokens=19),
        Arrive(25, "r6", prompt=((1000, 64), (11000, 29)), max_tokens=11),
        Arrive(25, "r7", prompt=((1000, 64), (11000, 29)), max_tokens=11, priority=2),
        Arrive(25, "r8", prompt=((11000, 29),), max_tokens=11, priority=2),
        Arrive(32, "r9", prompt=((1000, 64), (12000, 45)), max_tokens=15, priority=1),
        Arrive(32, "r10", prompt=((1000, 64), (12000, 22)), max_tokens=15, priority=1),
        Arrive(33, "r11", prompt=((1000, 64), (7000, 71), (13000, 44)), max_tokens=6),
        Arrive(34, "r12", prompt=((1000, 64), (14000, 23)), max_tokens=2),
        Arrive(34, "r13", prompt=((1000, 64), (15000, 24)), max_tokens=1),
        Arrive(34, "r14", prompt=((1000, 64), (16000, 143)), max_tokens=8, priority=2),
        Arrive(35, "r15", prompt=((1000, 64), (9000, 39), (17000, 41)), max_tokens=1, priority=1),
        Arrive(35, "r16", prompt=((1000, 64), (9000, 39), (17000, 40)), max_tokens=10, priority=1),
        Arrive(35, "r17", prompt=((1000, 64), (9000, 39), (17000, 40)), max_tokens=10, priority=1),
        Arrive(35, "r18", prompt=((1000, 64), (9000, 39), (17000, 41)), max_tokens=5, priority=1),
        Arrive(35, "r19", prompt=((1000, 64), (9000, 39), (18000, 34)), max_tokens=19),
        Arrive(36, "r20", prompt=((19000, 83),), max_tokens=6),
        Arrive(38, "r21", prompt=((1000, 64), (16000, 84), (20000, 13)), max_tokens=7, priority=1),
        Arrive(39, "r22", prompt=((1000, 64), (16000, 143)), max_tokens=8, priority=1),
        Arrive(40, "r23", prompt=((1000, 64), (16000, 144)), max_tokens=4),
        Arrive(41, "r24", prompt=((1000, 64), (7000, 71), (21000, 25)), max_tokens=11),
        Arrive(51, "r25", prompt=((1000, 64), (22000, 79), (23000, 17)), max_tokens=15, priority=1),
        Arrive(52, "r26", prompt=((1000, 64), (7000, 71), (24000, 37)), max_tokens=1, priority=2),
        Arrive(52, "r27", prompt=((1000, 64), (7000, 71), (24000, 37)), max_tokens=1, priority=2),
        Arrive(53, "r28", prompt=((1000, 64), (25000, 12)), max_tokens=7),
        Arrive(58, "r29", prompt=((1000, 64), (26000, 42)), max_tokens=14),
        Arrive(59, "r30", prompt=((27000, 24),), max_tokens=20),
        Arrive(64, "r31", prompt=((1000, 64), (22000, 79), (28000, 17)), max_tokens=6),
        Arrive(74, "r32", prompt=((29000, 19),), max_tokens=4),
        Arrive(74, "r33", prompt=((1000, 64), (30000, 28)), max_tokens=5),
        Arrive(74, "r34", prompt=((1000, 64), (31000, 25)), max_tokens=1),
        Arrive(74, "r35", prompt=((1000, 64), (32000, 5)), max_tokens=5),
        Arrive(76, "r36", prompt=((33000, 58),), max_tokens=5),
        Arrive(78, "r37", prompt=((1000, 64), (34000, 204)), max_tokens=1, priority=1),
        Arrive(80, "r38", prompt=((1000, 64), (34000, 203)), max_tokens=3, priority=1),
        Arrive(84, "r39", prompt=((1000, 64), (35000, 26)), max_tokens=17, priority=1),
        Arrive(95, "r40", prompt=((1000, 64),), max_tokens=14),
        Arrive(99, "r41", prompt=((1000, 64), (7000, 71), (36000, 17)), max_tokens=16),
        Arrive(109, "r42", prompt=((1000, 64), (22000, 79), (37000, 37)), max_tokens=1, priority=1),
    ),
)


#: Two partial failed loads (``kv-load-partial``'s shape, found by a random search over
#: small workloads, vLLM 0.32): r2's load fails on its first block only and r2 is aborted;
#: the block that loaded fine keeps its entry. r1 loads the same prefix again, failing on
#: its second block, and computes its next block over it; r0, admitted in that same step,
#: hits r1's first block, r2's kept block and r1's computed one.
PARTIAL_FAILED_LOADS = Workload(
    spec=SchedulerSpec(
        block_size=4,
        num_blocks=10,
        max_num_seqs=4,
        max_num_batched_tokens=12,
        max_model_len=64,
        long_prefill_token_threshold=8,
        async_scheduling=True,
        kv_load_failure_policy="recompute",
    ),
    depth=2,
    events=(
        Arrive(1, "r2", ((200, 12), (1002, 5)), 3, 1, 8, True, (0,)),
        Abort(1, "r2"),
        Arrive(2, "r1", ((200, 12), (1001, 4)), 3, 1, 8, True, (1,)),
        Arrive(3, "r0", ((200, 12), (1000, 6)), 1, 0, 4, True),
        Arrive(3, "r3", ((100, 4), (1003, 4)), 1),
    ),
)


# ``hybrid-partial-victim-sparse`` (vLLM 0.32, seed 1), shrunk: the priority-preemption
# zombie under an engine's default prefix-cache retention (interval 0), where the only state
# a prompt leaves cached is its checkpoint. Step 5's ``schedule()`` gives r1 its chunk to
# 272 tokens (its prompt's checkpoint), registers the checkpoint, and preempts r1 in the
# same call (r3, r1's prompt at a higher priority, is scheduled in that step); r1 resumes in
# step 8 on its own entry, a block holding another request's state (not zeroed).
HYBRID_SPARSE_ZOMBIE_CHECKPOINT = Workload(
    # hybrid-victim's scheduler, as the partial and sparse variants change it.
    spec=dataclasses.replace(
        HYBRID_WRONG_STATE_0_33.spec, mamba_block_multiple=4, retention_interval=0
    ),
    depth=1,
    events=(
        Arrive(0, "r0", prompt=((1000, 64), (2000, 23)), max_tokens=4),
        Arrive(0, "r1", prompt=((1000, 64), (3000, 213)), max_tokens=1, priority=2),
        Arrive(1, "r2", prompt=((1000, 64),), max_tokens=5),
        Arrive(2, "r3", prompt=((1000, 64), (3000, 213)), max_tokens=1, priority=1),
    ),
)


# ``hybrid-partial-kv-load-async`` (vLLM 0.33, seed 5), shrunk: a hybrid model whose state
# block spans four attention blocks, asynchronous loads around it. Step 49's
# ``schedule()`` gives r11 the chunk that ends at 192 tokens, registers its state block for
# 192 (block 43, which held another request's state: state blocks are not zeroed) and
# preempts r11 in the same call; r11 resumes in step 50 on its own zombie entry.
HYBRID_PARTIAL_ZOMBIE_STATE = Workload(
    spec=SchedulerSpec(
        num_blocks=48,
        max_model_len=4096,
        policy="priority",
        long_prefill_token_threshold=64,
        async_scheduling=True,
        kv_load_failure_policy="recompute",
        mamba_align=True,
        mamba_block_multiple=4,
    ),
    depth=2,
    events=(
        Arrive(0, "r0", prompt=((1000, 32), (2000, 167)), max_tokens=1, priority=2),
        Arrive(
            9,
            "r1",
            prompt=((1000, 32), (3000, 74), (4000, 16)),
            max_tokens=23,
            external_tokens=106,
            fail_load=True,
            async_load_steps=3,
        ),
        Arrive(13, "r2", prompt=((1000, 32), (2000, 167), (5000, 90)), max_tokens=23),
        Arrive(18, "r3", prompt=((1000, 32), (6000, 96)), max_tokens=1, priority=2),
        Arrive(
            18,
            "r4",
            prompt=((1000, 32), (7000, 128), (8000, 11)),
            max_tokens=2,
            external_tokens=160,
            async_load_steps=1,
        ),
        Arrive(19, "r5", prompt=((1000, 32), (9000, 110)), max_tokens=4),
        Arrive(24, "r6", prompt=((1000, 32), (6000, 193)), max_tokens=6),
        Arrive(
            25,
            "r7",
            prompt=((1000, 32), (10000, 203), (11000, 91)),
            max_tokens=4,
            external_tokens=235,
            async_load_steps=1,
        ),
        Arrive(
            26,
            "r8",
            prompt=((1000, 32), (3000, 74), (12000, 44)),
            max_tokens=2,
            priority=3,
            external_tokens=106,
            async_load_steps=3,
        ),
        Arrive(
            34,
            "r9",
            prompt=((1000, 32), (2000, 167), (13000, 34)),
            max_tokens=1,
            priority=3,
            external_tokens=199,
            async_load_steps=3,
        ),
        Arrive(44, "r10", prompt=((1000, 32), (14000, 43)), max_tokens=4, priority=3),
        Arrive(50, "r11", prompt=((1000, 32), (2000, 167)), max_tokens=1, priority=3),
        Arrive(50, "r12", prompt=((1000, 32), (2000, 167)), max_tokens=1, priority=3),
    ),
)


# Async priority: r4 (lowest priority) is preempted by the arrivals of step 9 while a step
# of its in flight samples the token that fills its block at 192 tokens; the preempting
# schedule() registers that block (a block whose last token a step in flight samples is
# registered one step late), and the preemption rule keeps the entry, tied to the step in
# flight, which writes it. Shrunk from priority-phased-async seed 1 (vLLM 0.32) with the
# rule's exception taken out (``every_preempted_entry_goes``): the guard then rolls back
# that valid entry and reads nothing bad, a precision finding only the audit sees.
PREEMPTED_WITH_ITS_BLOCK_WRITTEN_IN_FLIGHT = Workload(
    spec=SchedulerSpec(
        num_blocks=40,
        max_model_len=4096,
        policy="priority",
        long_prefill_token_threshold=64,
        async_scheduling=True,
        kv_events=True,
    ),
    depth=2,
    events=(
        Arrive(0, "r0", prompt=((1000, 116), (2000, 29)), max_tokens=1),
        Arrive(3, "r1", prompt=((3000, 138),), max_tokens=20),
        Arrive(4, "r2", prompt=((1000, 116), (4000, 35)), max_tokens=19),
        Arrive(6, "r3", prompt=((5000, 30),), max_tokens=12),
        Arrive(7, "r4", prompt=((3000, 138), (6000, 48)), max_tokens=15, priority=5),
        *(
            Arrive(9, f"r{i}", prompt=((7000, 66), (8000, 10)), max_tokens=5 if i == 5 else 10)
            for i in (5, 6, 7, 8)
        ),
    ),
)


def every_preempted_entry_goes(monkeypatch: Any) -> None:
    """Take the preemption rule's exception out: every entry the open step registered for
    a request preempted in it goes, those a step in flight writes included."""
    from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache

    rollback_preempted = UncommittedPrefixCache.rollback_preempted

    def all_of_them(self: Any, req_id: str, num_written_tokens: int) -> None:
        rollback_preempted(self, req_id, 0)

    monkeypatch.setattr(UncommittedPrefixCache, "rollback_preempted", all_of_them)
