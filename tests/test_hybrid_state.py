"""The oracle's state groups: a hybrid model's recurrent state per block, in align mode.

The scheduler is vLLM's own with a full-attention group and a Mamba group in ``align``
mode (``SchedulerSpec(mamba_align=True)``); the shadow worker keeps, per state block, which
prefix's state it holds, and checks the state every step starts from (a prefix hit
resumes from the block registered for the hit). These tests pin that the oracle follows
state through valid hits without a false alarm, and that it sees a resume from a state
that was never written: the shape of vLLM PR #56525's report (async scheduling, an
aborted prefill retried at once, a worker that leaves the aborted request out of the step
already dispatched), which the guard does not cover today (it assumes, as vLLM's runners
do, that a dispatched step computes every request in it).
"""

from __future__ import annotations

from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.shadow_kv import STATE_NEVER_WRITTEN, Driver

PROMPT = list(range(1, 161))  # ten 16-token blocks: prefilled in 64-token chunks


def retried_abort(drop_aborted: bool) -> Driver:
    """A's first 64 tokens are dispatched (its state for 64 registered), A is aborted
    while that step is in flight and retried at once with the same prompt."""
    scheduler = make_scheduler(
        num_blocks=64, mamba_align=True, async_scheduling=True, max_num_batched_tokens=64
    )
    driver = Driver(scheduler, depth=2, drop_aborted=drop_aborted)
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
    driver = retried_abort(drop_aborted=False)
    assert driver.hit_tokens > 0 and driver.worker.states[0].resumed_from_hits > 0
    assert driver.violations == 0, dict(driver.kv.counts)


def test_oracle_sees_a_resume_from_never_written_state() -> None:
    """A worker that drops the aborted request: the state block registered for its
    64 tokens is never written, and the retry starts from it (stock vLLM)."""
    driver = retried_abort(drop_aborted=True)
    assert driver.kv.counts[STATE_NEVER_WRITTEN] > 0
    assert any(
        v.request_id == "A-retry" and v.kind == STATE_NEVER_WRITTEN for v in driver.kv.violations
    )
