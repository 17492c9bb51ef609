"""Asynchronous KV-connector loads (``WAITING_FOR_REMOTE_KVS``), on attention and hybrid.

vLLM allocates an asynchronous load's blocks with ``delay_cache_blocks`` and registers
them only in ``_update_waiting_for_remote_kv``, once a step's output lists the request in
``finished_recving``: after the load, unlike a synchronous one. A whole failure is
reported per request (``failed_recving``: the only report vLLM 0.31+ takes on a model with
several KV-cache groups) and the request starts over; a failure of some blocks (one
group only) truncates it to the blocks before the first failed one, which alone are
registered. Stock vLLM reads nothing bad here, and the guard (which records those
entries in the open step like any other) must change nothing: these tests hold both
to the shadow-KV oracle, which on a hybrid model also checks the boundary state the
connector loads.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_prefix_guard_harness import connector as fake_connector
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.shadow_kv import STATE_NEVER_WRITTEN, Driver

PREFIX = list(range(1, 65))  # four 16-token blocks
LOADER_PROMPT = PREFIX + list(range(1000, 1010))
FOLLOWER_PROMPT = PREFIX + list(range(2000, 2010))


def loading_driver(
    *, hybrid: bool, fails: bool, failed_blocks: frozenset[int] | None = None
) -> Driver:
    """A loader whose 64-token prefix loads asynchronously over two executed steps, and
    nothing else yet; sync scheduling, so each engine iteration is one step."""
    scheduler = make_scheduler(
        num_blocks=48, kv_load_failure_policy="recompute", mamba_align=hybrid
    )
    connector = scheduler.connector
    connector.external_tokens["loader"] = len(PREFIX)
    connector.async_loads["loader"] = 2
    if fails:
        connector.fail_loads.add("loader")
        if failed_blocks is not None:
            connector.failed_blocks["loader"] = failed_blocks
    driver = Driver(scheduler)
    driver.add(make_request("loader", LOADER_PROMPT, max_tokens=4))
    return driver


def cached_tokens(scheduler: Any, prompt: list[int]) -> int:
    """Tokens of ``prompt`` the prefix cache would hand a new request now."""
    return int(scheduler.kv_cache_manager.get_computed_blocks(make_request("probe", prompt))[1])


@pytest.mark.parametrize("hybrid", [False, True], ids=["attention", "hybrid"])
def test_async_load_is_registered_once_done(mode: str, hybrid: bool) -> None:
    """While the load runs its blocks are the loader's alone; once it is reported done
    they are registered, and a follower's hit on them (KV and, on a hybrid model, the
    boundary state) reads what the load wrote."""
    from vllm.v1.request import RequestStatus

    driver = loading_driver(hybrid=hybrid, fails=False)
    scheduler = driver.scheduler
    driver.step()  # the load starts; the loader computes nothing
    assert scheduler.requests["loader"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert cached_tokens(scheduler, FOLLOWER_PROMPT) == 0
    driver.step()  # its output reports the load done
    driver.add(make_request("follower", FOLLOWER_PROMPT, max_tokens=4))
    driver.run()
    assert cached_tokens(scheduler, FOLLOWER_PROMPT) == len(PREFIX)
    assert driver.violations == 0


def test_hybrid_async_load_failure_starts_over(mode: str) -> None:
    """A whole failure, reported per request on a hybrid model: the loader's blocks are
    freed unregistered and it computes its prompt from the start; a follower that arrived
    meanwhile hits nothing of the failed load."""
    driver = loading_driver(hybrid=True, fails=True)
    driver.step()
    driver.add(make_request("follower", FOLLOWER_PROMPT, max_tokens=4))
    driver.step()  # the failure is reported
    driver.run()
    assert driver.violations == 0
    # The loader computed its whole prompt, one token and its decodes; the follower's
    # hit is what the loader computed, not what failed to load.
    assert driver.scheduled_tokens >= len(LOADER_PROMPT) + len(FOLLOWER_PROMPT) - len(PREFIX)


def test_partial_async_load_failure_registers_the_blocks_before_it(mode: str) -> None:
    """Blocks 2 and 3 of four fail: vLLM truncates the loader to the two blocks before
    them, registers those when the load is reported, and recomputes the rest."""
    driver = loading_driver(hybrid=False, fails=True, failed_blocks=frozenset({2, 3}))
    scheduler = driver.scheduler
    driver.step()
    driver.step()  # the failure is reported by block id; nothing is registered yet
    assert cached_tokens(scheduler, FOLLOWER_PROMPT) == 0
    driver.step()  # the loader resumes from its valid 32 tokens, registered now
    assert scheduler.requests["loader"].num_computed_tokens > 32
    driver.add(make_request("follower", FOLLOWER_PROMPT, max_tokens=4))
    driver.run()
    assert cached_tokens(scheduler, FOLLOWER_PROMPT) == len(PREFIX)
    assert driver.violations == 0


def test_oracle_reads_a_boundary_state_the_connector_left_unloaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The oracle has teeth: a connector that loads the KV but not the state after it
    leaves the loader starting from a state block nothing wrote."""
    monkeypatch.setattr(fake_connector.FakeLoadConnector, "_state_blocks", lambda *_: [])
    driver = loading_driver(hybrid=True, fails=False)
    driver.run()
    assert driver.kv.counts[STATE_NEVER_WRITTEN] == 1
    assert {v.request_id for v in driver.kv.violations} == {"loader"}
