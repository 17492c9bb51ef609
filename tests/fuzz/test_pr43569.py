"""The PR #43569 comparator: the guard's ledger with the victim rolled back in every bucket."""

from __future__ import annotations

from vllm_prefix_guard import plugin
from vllm_prefix_guard.diagnostics.factory import make_request, make_scheduler
from vllm_prefix_guard.diagnostics.fuzz.configs import CONFIGS
from vllm_prefix_guard.diagnostics.fuzz.pr43569 import adopt_pr43569_scope
from vllm_prefix_guard.diagnostics.fuzz.runner import run_workload
from vllm_prefix_guard.hooks import ledger_of


def test_rolls_back_the_victim_in_dispatched_steps() -> None:
    plugin.apply()
    scheduler = make_scheduler(num_blocks=20, async_scheduling=True)
    ledger = ledger_of(scheduler)
    assert ledger is not None
    counters = adopt_pr43569_scope(ledger)
    scheduler.add_request(make_request("a", list(range(1, 33))))
    scheduler.schedule()  # step 1 registers a's 2 blocks and is dispatched
    ledger.begin_step()
    ledger.rollback_preempted("a")
    assert counters.entries == 2 and counters.requests == 1
    assert ledger.stats.rolled_back_preempted == 2
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block


def test_changes_one_ledger_only() -> None:
    plugin.apply()
    one, other = (ledger_of(make_scheduler(async_scheduling=True)) for _ in range(2))
    assert one is not None and other is not None
    scope = adopt_pr43569_scope(one)
    assert one.preemption_scope is scope
    assert other.preemption_scope is None


def test_only_the_wider_scope_undoes_in_flight_entries() -> None:
    workload = CONFIGS["priority-phased-async"].workload(0, horizon=300)
    assert run_workload(workload, "pr43569").rolled_back_in_flight > 0
    assert run_workload(workload, "guard").rolled_back_in_flight == 0
