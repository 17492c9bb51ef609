"""The guard with one rule taken out: what the explorer must catch (its teeth).

Each mutation is a subclass of the rules or of their failed-load rollback, attached
with ``hooks.attach_guard``; the rules themselves are untouched. With the
rule gone, a violation the rule prevents must be found within the mutation's scope
(``MUTATION_SCOPES``); stock vLLM (the plugin undone) stands in for the priority
preemption rule, whose absence is stock's zombie.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from vllm.v1.core.sched.output import SchedulerOutput

from vllm_prefix_guard.hooks import attach_guard
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache


class OtherReaders(FailedKVLoads):
    """The rules' failed-load rollback, then other requests judged readers of bad KV
    (those the guard preempts): what a mutation of that judgement returns."""

    def roll_back(self, scheduler_output: SchedulerOutput, invalid_block_ids: set[int]) -> None:
        super().roll_back(scheduler_output, invalid_block_ids)
        self.readers = self.mutated_readers()

    def mutated_readers(self) -> set[str]:
        raise NotImplementedError


class ReadersKeepBadKV(OtherReaders):
    """No reader of a failed load is preempted: requests that hit a block whose load
    failed (or KV computed over it) keep it as computed (vLLM truncates only the first
    holder of an invalid block)."""

    def mutated_readers(self) -> set[str]:
        return set()


class WithoutDroppedStepRollback(UncommittedPrefixCache):
    """The guard, minus rule 2: a step whose output never came back keeps its entries
    (committed as if it ran, when a later step commits)."""

    def commit_step(self, scheduler_output: SchedulerOutput) -> None:
        steps = self.steps_in_flight()
        if not any(output is scheduler_output for output, _ in steps):
            return  # an output schedule() did not produce commits nothing
        for output, _ in steps:
            super().commit_step(output)
            if output is scheduler_output:
                return


class ReadmittedLoadersStayLoaders(OtherReaders):
    """No loader admitted afresh in a later step is judged a reader there: a loader
    preempted (by a reset of the running requests) before its failed load's report, and
    resumed at once on its own load's entries, is taken for the loader only, and vLLM's
    truncation of the loader leaves the token that step sampled over the failed KV
    deliverable (the ``everything-async`` seed-2 soak finding)."""

    def mutated_readers(self) -> set[str]:
        return self.readers - self.loaders.keys()


class Mutation(NamedTuple):
    """The rules a mutated guard runs, and its failed-load rollback."""

    rules: type[UncommittedPrefixCache]
    rollback: type[FailedKVLoads]

    def attach(self, scheduler: Any) -> None:
        attach_guard(scheduler, self.rules(scheduler.kv_cache_manager), self.rollback)


#: Mutation name -> the guard it runs instead.
MUTATIONS: dict[str, Mutation] = {
    "no-reader-rollback": Mutation(UncommittedPrefixCache, ReadersKeepBadKV),
    "no-dropped-step-rollback": Mutation(WithoutDroppedStepRollback, FailedKVLoads),
    "no-readmitted-reader": Mutation(UncommittedPrefixCache, ReadmittedLoadersStayLoaders),
}

#: What each mutation (and stock, for the zombie) must be caught on: a small scope.
MUTATION_SCOPES: dict[str, str] = {
    "stock": "ci",
    "no-reader-rollback": "sync-fcfs-recompute",
    "no-dropped-step-rollback": "async-fcfs-recompute",
    "no-readmitted-reader": "async-reset-loader",
}
