"""Same-step sharing stays intact, and a same-step dependent of a rollback recomputes.

vLLM registers a step's full blocks before the forward so that other requests in the
same batch reuse them (identical prompts, ``n>1`` children): one forward writes every
layer's KV for the whole batch before attention reads it. The guard must not hide
those entries. If the writer is withdrawn from the step after a reader hit them, the
reader would attend over KV nobody writes: vLLM 0.32/0.33 cannot do that (lookups run
only when the running loop preempted nobody), so the last test simulates a scheduler
that can, and checks the reader is preempted to recompute.
"""

from __future__ import annotations

import time
from typing import Any

from native_fix import guard_only
from vllm_prefix_guard import plugin
from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.shadow_kv import NEVER_WRITTEN, Driver
from vllm_prefix_guard.hooks import ledger_of
from vllm_prefix_guard.recovery import withdraw_from_output


def first_step(prompt_len: int, copies: int) -> tuple[dict[str, int], int]:
    scheduler = make_scheduler(num_blocks=200, max_num_batched_tokens=4096)
    driver = Driver(scheduler)
    prompt = list(range(1, prompt_len + 1))
    for i in range(copies):
        driver.add(make_request(f"n{i}", prompt, max_tokens=4))
    output = driver.schedule()
    driver.complete()
    driver.run()
    return dict(output.num_scheduled_tokens), driver.violations


def test_identical_prompts_share_fresh_blocks_in_one_step() -> None:
    stock = first_step(64, 2)
    plugin.apply()
    guarded = first_step(64, 2)
    assert stock == guarded == ({"n0": 64, "n1": 16}, 0)


def test_parallel_sampling_children_share_the_prompt() -> None:
    """``n=4`` on a 512-token prompt: 512 + 3 x 16 tokens, not 4 x 512 (notes §2.3)."""
    stock = first_step(512, 4)
    plugin.apply()
    guarded = first_step(512, 4)
    assert sum(guarded[0].values()) == sum(stock[0].values()) == 560
    assert guarded[1] == stock[1] == 0


#: vLLM's own fix (upstream/README.md) relies on what vLLM's scheduler guarantees: no
#: lookup runs after a preemption in the same ``schedule()``.
LATE_PREEMPTION = guard_only("it relies on vLLM's scheduler never preempting after a lookup")


def preempt_writer_after_waiting_loop(scheduler: Any, writer: str) -> None:
    """Make this scheduler withdraw and preempt ``writer`` at the end of ``schedule()``,
    after a reader hit its fresh blocks: what a scheduler that preempts late would do."""
    original = scheduler._update_after_schedule

    def _update_after_schedule(output: Any) -> None:
        del scheduler._update_after_schedule  # once
        request = scheduler.requests[writer]
        withdraw_from_output(output, writer)
        scheduler.running.remove(request)
        scheduler._preempt_request(request, time.monotonic())
        output.preempted_req_ids = {*(output.preempted_req_ids or ()), writer}
        original(output)

    scheduler._update_after_schedule = _update_after_schedule


@LATE_PREEMPTION
def test_same_step_dependent_of_rollback_recomputes(mode: str) -> None:
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=1024)
    driver = Driver(scheduler)
    prompt = list(range(1, 65))
    driver.add(make_request("writer", prompt, max_tokens=4))
    driver.add(make_request("reader", prompt, max_tokens=4))
    preempt_writer_after_waiting_loop(scheduler, "writer")
    driver.run()
    if mode == "stock":
        assert driver.kv.counts[NEVER_WRITTEN] > 0
        assert "reader" in {v.request_id for v in driver.kv.violations}
        return
    assert driver.violations == 0
    ledger = ledger_of(scheduler)
    assert ledger is not None
    assert ledger.stats.dependents_preempted == 1 and ledger.is_idle
    assert scheduler.requests == {}  # both finished after recomputing


@LATE_PREEMPTION
def test_a_dependent_of_a_dependent_is_withdrawn_in_the_same_step(mode: str) -> None:
    """Withdrawing a dependent rolls back its own fresh blocks, which a third request in
    the same step may have hit: it is withdrawn too, in that step, and no contested block
    id is left over for the next step (where it could name a block reused since)."""
    scheduler = make_scheduler(num_blocks=64, max_num_batched_tokens=1024)
    driver = Driver(scheduler)
    prompt = list(range(1, 65))
    first_suffix = list(range(1000, 1032))
    second_suffix = list(range(2000, 2032))
    driver.add(make_request("writer", prompt, max_tokens=4))
    driver.add(make_request("reader", prompt + first_suffix, max_tokens=4))
    driver.add(make_request("reader2", prompt + first_suffix + second_suffix, max_tokens=4))
    preempt_writer_after_waiting_loop(scheduler, "writer")
    output = driver.schedule()
    if mode == "stock":
        driver.run()
        assert driver.kv.counts[NEVER_WRITTEN] > 0
        return
    ledger = ledger_of(scheduler)
    assert ledger is not None
    assert set(output.num_scheduled_tokens) == set()  # all three recompute from scratch
    assert not ledger.has_contested_blocks
    assert ledger.stats.dependents_preempted == 2
    driver.run()
    assert driver.violations == 0 and ledger.is_idle
    assert scheduler.requests == {}
