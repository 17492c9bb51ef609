"""The fuzzer's meters on top of the shadow-KV oracle, pinned on small known layouts."""

from __future__ import annotations

from layouts import zombie_workload
from vllm_prefix_guard_harness.factory import SchedulerSpec
from vllm_prefix_guard_harness.fuzz.runner import run_workload
from vllm_prefix_guard_harness.fuzz.workload import Arrive, Workload

E2 = zombie_workload()


def test_hits_on_bad_kv_are_attributed() -> None:
    stock, guard = run_workload(E2, "stock"), run_workload(E2, "guard")
    # C's first admission hits 9 blocks; on stock one of them was never written.
    assert (stock.hit_tokens, stock.invalid_hit_tokens) == (144, 16)
    assert stock.bad_admissions >= 2  # C, and A resuming over its own zombie
    assert guard.violations == 0
    assert (guard.invalid_hit_tokens, guard.bad_admissions) == (0, 0)
    # The guard recomputes the block stock skipped.
    assert guard.computed_tokens == stock.computed_tokens + 16


def test_steps_over_a_failed_load_are_discarded_not_violations() -> None:
    """r1 shares r0's sync-loaded blocks in the step whose load fails; the next step,
    already dispatched, reads KV r1 computed over them. vLLM drops both outputs once
    the failure is reported, on stock and guarded alike."""
    workload = Workload(
        SchedulerSpec(
            long_prefill_token_threshold=64, async_scheduling=True, kv_load_failure_policy="fail"
        ),
        2,
        (
            Arrive(0, "r0", ((1000, 51), (2000, 9)), 1, external_tokens=51, fail_load=True),
            Arrive(0, "r1", ((1000, 51), (2000, 9)), 2),
        ),
    )
    for mode in ("stock", "guard"):
        result = run_workload(workload, mode)
        assert result.violations == 0, result.examples
        assert result.loaded_tokens == 48


def test_a_reported_block_with_right_content_is_a_clean_read() -> None:
    """A reported invalid block id can name a block that was freed and rewritten since
    (reused by a load that succeeded): reading right content there is no loss, so the
    reader is not tainted; wrong content there is unclean but vLLM's known loss."""
    from vllm_prefix_guard_harness.fuzz.oracle import FuzzKV
    from vllm_prefix_guard_harness.shadow_kv import ScheduledRead, TokenModel

    kv = FuzzKV(block_size=4)
    model = TokenModel(list(range(8)))
    for position in range(8):
        kv.write(7 + position // 4, position % 4, model.fingerprint(position))
    read = ScheduledRead("r", model, start=8, num_tokens=1, block_ids=[7, 8, 9], samples=True)
    assert kv.check_reads(0, read, skip_blocks={8})
    assert kv.discarded_reads == 0
    kv.write(8, 1, ~model.fingerprint(5))
    assert not kv.check_reads(1, read, skip_blocks={8})
    assert (kv.counts.total(), kv.discarded_reads) == (0, 1)  # known loss, not a violation
    assert not kv.check_reads(2, read, skip_blocks=set())
    assert kv.counts.total() == 1


def test_remembered_verification_sees_a_later_rewrite() -> None:
    """Reads are remembered (a request's verified prefix, a block's verified positions),
    yet a slot rewritten after its reader verified it is caught at the next read, and a
    first write into an empty slot changes nothing verified."""
    from vllm_prefix_guard_harness.shadow_kv import ScheduledRead, ShadowKV, TokenModel

    kv = ShadowKV(block_size=4)
    model = TokenModel(list(range(1, 11)))
    for position in range(10):
        kv.write(position // 4, position % 4, model.fingerprint(position))
    read = ScheduledRead("r", model, start=10, num_tokens=1, block_ids=[0, 1, 2], samples=True)
    assert kv.check_reads(0, read, set())
    kv.write(2, 3, model.fingerprint(11))  # fresh slot past the read: nothing to forget
    assert kv.check_reads(1, read, set())
    kv.write(1, 2, ~model.fingerprint(6))  # inside the verified prefix
    assert not kv.check_reads(2, read, set())
    assert (kv.counts.total(), kv.violations[0].position) == (1, 6)
    kv.write(1, 2, model.fingerprint(6))
    assert kv.check_reads(3, read, set())
    kv.write(2, 1, ~model.fingerprint(9))  # inside the verified part of the partial block
    assert not kv.check_reads(4, read, set())
    assert kv.counts.total() == 2


def test_a_callers_sampling_rule_sets_the_tokens_past_the_prompt() -> None:
    from vllm_prefix_guard_harness.shadow_kv import TokenModel, next_token

    greedy = TokenModel([5, 6, 7])
    assert greedy.token(3) == next_token(greedy.fingerprint(2))
    sampled = TokenModel([5, 6, 7], sample=lambda position: 100 + position)
    assert [sampled.token(p) for p in range(6)] == [5, 6, 7, 103, 104, 105]
    assert sampled.fingerprint(2) == greedy.fingerprint(2)
    assert sampled.fingerprint(3) != greedy.fingerprint(3)


def test_the_driver_calls_the_scheduler_through_its_hooks_only() -> None:
    """What a benchmark times: every ``schedule()`` and ``update_from_output()`` goes
    through ``call_schedule``/``call_update``; the trajectory digest repeats with the run."""
    from vllm_prefix_guard_harness.factory import make_request, make_scheduler
    from vllm_prefix_guard_harness.shadow_kv import Driver

    class Counting(Driver):
        def __init__(self, scheduler: object, depth: int) -> None:
            super().__init__(scheduler, depth)
            self.calls = {"schedule": 0, "update": 0}

        def call_schedule(self) -> object:
            self.calls["schedule"] += 1
            return super().call_schedule()

        def call_update(self, output: object, result: object) -> object:
            self.calls["update"] += 1
            return super().call_update(output, result)

    def run() -> Counting:
        driver = Counting(make_scheduler(num_blocks=40, async_scheduling=True), depth=2)
        for i in range(3):
            driver.add(make_request(f"r{i}", list(range(1, 40)), max_tokens=5))
        driver.run()
        return driver

    driver = run()
    assert driver.calls["schedule"] == driver.calls["update"] == len(driver.outputs) > 0
    assert driver.violations == 0 and driver.trajectory != 0
    assert run().trajectory == driver.trajectory
