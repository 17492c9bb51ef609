"""Same-step sharing stays intact, and no request can depend on a same-step rollback.

vLLM registers a step's full blocks before the forward so that other requests in the
same batch reuse them (identical prompts, ``n>1`` children): one forward writes every
layer's KV for the whole batch before attention reads it. The guard must not hide
those entries. If the writer were preempted in the same ``schedule()`` after a reader
hit them, the reader would attend over KV nobody writes: vLLM cannot do that (lookups
run only when the running loop preempted nobody), which the last test pins.
"""

from __future__ import annotations

from vllm_prefix_guard import plugin
from vllm_prefix_guard.rules.failed_kv_loads import resumed_req_ids
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import Driver


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


def test_no_lookup_follows_a_preemption_in_the_same_step() -> None:
    """What the rules rely on instead of withdrawing same-step dependents: once the
    running loop of ``schedule()`` preempted a request, the call admits nobody (the
    waiting loop, where every prefix-cache lookup runs, is skipped), so no request can
    hit an entry whose writer is preempted in the same call. Pinned on every tested vLLM
    under priority preemption with a backlog of requests sharing the victims' prefixes."""
    scheduler = make_scheduler(
        num_blocks=40,
        max_num_batched_tokens=256,
        policy="priority",
        long_prefill_token_threshold=64,
    )
    driver = Driver(scheduler)
    prompt = list(range(1, 161))
    for i in range(12):
        driver.add(make_request(f"r{i}", prompt + [1000 + i] * 8, max_tokens=24, priority=i % 3))
    preempting_steps = 0
    while scheduler.has_requests() or driver.in_flight:
        output = driver.schedule()
        if output.preempted_req_ids:
            preempting_steps += 1
            resumed = resumed_req_ids(output.scheduled_cached_reqs)
            assert not output.scheduled_new_reqs and not resumed, output
        driver.complete()
    assert preempting_steps > 0 and driver.violations == 0
