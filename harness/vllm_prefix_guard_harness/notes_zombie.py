"""The shared notes' deterministic reproduction, as a function ``doctor`` can run.

Priority policy, 20 blocks of 16 tokens: D (short, priority 0) and A (160 tokens,
priority 1) run; B (priority 0) arrives; in the next step A is scheduled first,
registers its next blocks, then B cannot allocate and A is preempted. C with A's
prompt arrives later. Stock vLLM 0.32/0.33 hands C and the resumed A a block that was
never written.
"""

from __future__ import annotations

from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import Driver


def zombie_layout(
    block_size: int = 16,
    async_scheduling: bool = False,
    depth: int | None = None,
    c_arrives: int | None = None,
) -> Driver:
    """Run the layout to completion and return the driver (its shadow KV holds the verdict).

    Args:
        block_size: 16 or a multiple; token counts scale with it.
        async_scheduling: use vLLM's ``AsyncScheduler``.
        depth: steps in flight (default 2 with async scheduling, else 1).
        c_arrives: engine iteration at which C arrives (default: right after A resumed).
    """
    k = block_size // 16
    scheduler = make_scheduler(
        policy="priority",
        num_blocks=20,
        block_size=block_size,
        long_prefill_token_threshold=64 * k,
        max_num_batched_tokens=256 * k,
        async_scheduling=async_scheduling,
        max_model_len=4096,
    )
    depth = depth or (2 if async_scheduling else 1)
    driver = Driver(scheduler, depth=depth)
    a_prompt = list(range(1, 1 + 160 * k))
    if c_arrives is None:
        c_arrives = 3 if depth == 1 else 4
    driver.add(make_request("D", list(range(1000, 1000 + 16 * k)), block_size, max_tokens=3))
    driver.add(make_request("A", a_prompt, block_size, max_tokens=4, priority=1))
    for iteration in range(12):
        if iteration == 1:
            b_prompt = list(range(2000, 2000 + 120 * k))
            driver.add(make_request("B", b_prompt, block_size, max_tokens=4))
        if iteration == c_arrives:
            driver.add(make_request("C", a_prompt, block_size, max_tokens=4, priority=1))
        driver.step()
    driver.run()
    return driver


def zombie_layout_violations() -> int:
    """Wrong reads in the layout on whatever vLLM (stock or guarded) is active."""
    return zombie_layout().violations
