"""Failed KV loads on a hybrid model: every KV-cache group, each in its own block size.

Full attention in 16-token blocks beside a sliding window in 32-token blocks (the
scheduler steps in 32, hashes in 16). A block-level load failure must be rolled back in
every group: a later request's prefix hit needs every group to hit, and each group's
KV of a token is computed from all groups' KV before it. vLLM 0.30 handles block-level
failures on such layouts by recomputing the affected request from scratch, and under
``recompute`` leaves the invalid blocks hashed (upstream #54733 / #56135 discuss the
group-aware fix); vLLM 0.31 and later refuse them with a ``RuntimeError`` (connectors must
report failed requests instead), so there these tests skip with that reason.
"""

from __future__ import annotations

from typing import Any

import pytest

from native_fix import guard_only
from vllm_prefix_guard.hooks import guard_of
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import Driver

SLIDING_WINDOW = 64
PROMPT = list(range(1, 146))  # 9 full 16-token blocks and one token


def hybrid_scheduler() -> Any:
    """Prefill in 32-token chunks, so a request recomputing a failed load rewrites its
    blocks over several steps, while a newcomer's hit is immediate."""
    return make_scheduler(
        num_blocks=96,
        sliding_window=SLIDING_WINDOW,
        kv_load_failure_policy="recompute",
        long_prefill_token_threshold=32,
        max_num_batched_tokens=512,
    )


def complete(driver: Driver, extra_invalid: set[int] | None = None) -> None:
    """Finish the oldest step, reporting ``extra_invalid`` blocks as failed loads too;
    skip when this vLLM refuses block-level failures on a multi-group layout."""
    from vllm.v1.outputs import KVConnectorOutput

    plan = driver.in_flight.popleft()
    result = driver.worker.execute(plan)
    if extra_invalid:
        output = result.kv_connector_output or KVConnectorOutput()
        output.invalid_block_ids = set(output.invalid_block_ids) | extra_invalid
        result.kv_connector_output = output
    try:
        driver.scheduler.update_from_output(plan.output, result)
    except RuntimeError as exc:
        if "multiple KV cache groups" in str(exc):
            pytest.skip(f"this vLLM refuses block-level load failures on hybrid models: {exc}")
        raise


def failed_full_attention_load() -> Driver:
    """The loader's first 64 tokens (four 16-token blocks) fail to load; a request with
    the same prompt arrives in the next step and hits what is still registered."""
    scheduler = hybrid_scheduler()
    scheduler.connector.external_tokens["loader"] = 64
    scheduler.connector.fail_loads.add("loader")
    driver = Driver(scheduler)
    driver.add(make_request("loader", PROMPT, max_tokens=2))
    driver.schedule()
    complete(driver)
    driver.add(make_request("reader", PROMPT, max_tokens=2))
    driver.run()
    return driver


def test_failed_load_is_rolled_back_in_the_full_attention_group(mode: str) -> None:
    driver = failed_full_attention_load()
    if mode == "stock":
        assert "reader" in {v.request_id for v in driver.kv.violations}
    else:
        assert driver.violations == 0


@guard_only("the guard's ledger")
def test_guard_counts_the_full_attention_rollback(guard: None) -> None:
    scheduler_guard = guard_of(failed_full_attention_load().scheduler)
    assert scheduler_guard is not None and scheduler_guard.is_idle
    assert scheduler_guard.stats.rolled_back_kv_load_failure > 0


def test_failed_load_in_the_window_group_is_rolled_back_there(mode: str) -> None:
    """The load fails in the sliding-window group (a 32-token block) while the full
    attention group loaded fine: the full-attention entries past the failure go too
    (each group's KV of a later token is computed over it), and a newcomer's hit stops
    before it. (The shadow KV follows the full-attention group only, so this is read
    off the hit itself.)"""
    scheduler = hybrid_scheduler()
    scheduler.connector.external_tokens["loader"] = 96
    driver = Driver(scheduler)
    driver.add(make_request("loader", PROMPT, max_tokens=2))
    driver.schedule()
    window_blocks = scheduler.kv_cache_manager.get_block_ids("loader")[1]
    failed = window_blocks[1]  # tokens 32-63 of the window group
    complete(driver, {failed})
    driver.add(make_request("reader", PROMPT, max_tokens=2))
    driver.schedule()
    hit = {read.request_id: read.start for read in driver.in_flight[-1].reads}["reader"]
    driver.run()
    if mode == "stock":
        assert hit >= 64  # over the window block that failed to load
    else:
        assert hit <= 32  # nothing past the first failed token, in any group
        assert driver.violations == 0
