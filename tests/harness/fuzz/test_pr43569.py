"""The PR #43569 comparator: the guard's rules with the victim rolled back in every step
in flight."""

from __future__ import annotations

from vllm_prefix_guard import plugin
from vllm_prefix_guard.hooks import attach_guard, guard_of
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard_harness.factory import make_request, make_scheduler
from vllm_prefix_guard_harness.fuzz.configs import CONFIGS
from vllm_prefix_guard_harness.fuzz.pr43569 import EveryStepInFlight
from vllm_prefix_guard_harness.fuzz.runner import run_workload


def test_rolls_back_the_victim_in_dispatched_steps() -> None:
    plugin.apply()
    scheduler = make_scheduler(num_blocks=20, async_scheduling=True)
    rules = EveryStepInFlight(scheduler.kv_cache_manager)
    guard = attach_guard(scheduler, rules)
    assert guard is not None and guard.rules is rules
    scheduler.add_request(make_request("a", list(range(1, 33))))
    scheduler.schedule()  # step 1 registers a's 2 blocks and is dispatched
    guard.begin_step()
    guard.preempted(scheduler.requests["a"])
    assert rules.entries == 2 and rules.requests == 1
    assert guard.stats.rolled_back_preempted == 2
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block


def test_changes_one_scheduler_only() -> None:
    plugin.apply()
    one, other = (make_scheduler(async_scheduling=True) for _ in range(2))
    rules = EveryStepInFlight(one.kv_cache_manager)
    attach_guard(one, rules)
    one_guard, other_guard = guard_of(one), guard_of(other)
    assert one_guard is not None and other_guard is not None
    assert one_guard.rules is rules
    assert type(other_guard.rules) is UncommittedPrefixCache


def test_only_the_wider_scope_undoes_in_flight_entries() -> None:
    workload = CONFIGS["priority-phased-async"].workload(0, horizon=300)
    assert run_workload(workload, "pr43569").rolled_back_in_flight > 0
    assert run_workload(workload, "guard").rolled_back_in_flight == 0
