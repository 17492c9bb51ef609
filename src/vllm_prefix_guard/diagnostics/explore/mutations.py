"""The guard with one rule taken out: what the explorer must catch (its teeth).

Each mutation is a subclass of the rules, attached the way the fuzzer attaches PR
#43569's scope (``hooks.attach_guard``); the rules themselves are untouched. With the
rule gone, a violation the rule prevents must be found within the mutation's scope
(``MUTATION_SCOPES``); stock vLLM (the plugin undone) stands in for the priority
preemption rule, whose absence is stock's zombie.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

from vllm.v1.core.sched.output import SchedulerOutput

from vllm_prefix_guard.rules.block_pool import StepCacheEntries
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads, admissions
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache


class OtherReaders(FailedKVLoads):
    """The rules' failed-load walk, then other requests judged readers of bad KV (those
    the guard preempts): what a mutation of that judgement returns."""

    def walk(
        self,
        steps: list[tuple[SchedulerOutput, StepCacheEntries]],
        invalid_block_ids: set[int],
        loader_req_ids: Collection[str] | None = None,
    ) -> None:
        super().walk(steps, invalid_block_ids, loader_req_ids)
        self.readers = self.mutated_readers()

    def mutated_readers(self) -> set[str]:
        raise NotImplementedError


class ReadersKeepBadKV(OtherReaders):
    """No reader of a failed load is preempted: requests that hit a block whose load
    failed (or KV computed over it) keep it as computed (vLLM truncates only the first
    holder of an invalid block)."""

    def mutated_readers(self) -> set[str]:
        return set()


class OtherFailedLoadWalk(UncommittedPrefixCache):
    """The guard with its failed-load rollback run by ``walk_class`` (a mutation of
    ``FailedKVLoads``); the body is the rules' own ``rollback_failed_loads``."""

    walk_class: type[FailedKVLoads] = FailedKVLoads

    def rollback_failed_loads(
        self,
        scheduler_output: SchedulerOutput,
        invalid_block_ids: set[int],
        running_req_ids: set[str],
        loader_req_ids: Collection[str] | None = None,
    ) -> FailedKVLoads:
        rollback = self.walk_class(self, running_req_ids)
        rollback.roll_back(scheduler_output, invalid_block_ids, loader_req_ids)
        return rollback


class WithoutReaderRollback(OtherFailedLoadWalk):
    """The guard, minus the preemption of failed-load readers."""

    walk_class = ReadersKeepBadKV


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


class KeptEntriesStay(FailedKVLoads):
    """``FailedKVLoads.walk`` without the rule the ``everything-async`` seed-17 soak
    finding added: a reader's kept entries that a later step in flight computes again
    from a lower token are no longer undone. The rest of ``walk`` is copied verbatim
    (``tests/explore/test_mutations.py`` checks the copy against the original)."""

    def walk(
        self,
        steps: list[tuple[SchedulerOutput, StepCacheEntries]],
        invalid_block_ids: set[int],
        loader_req_ids: Collection[str] | None = None,
    ) -> None:
        self.steps = steps
        self.bad_blocks.update(dict.fromkeys(invalid_block_ids, False))
        loaders = self._remove_loaders(*steps[0], invalid_block_ids, loader_req_ids)
        tainted = set(loaders)
        kept: dict[str, StepCacheEntries] = {}
        readmitted: set[str] = set()
        for index, (output, entries) in enumerate(steps):
            self.index = index
            copied_from = self._copied_from_bad(output) if index else {}
            admitted: dict[str, tuple[Sequence[Sequence[int]], int]] = {}
            for req_id, block_ids, num_computed_tokens in admissions(output):
                if index or req_id not in loaders:
                    if req_id in loaders:
                        readmitted.add(req_id)
                    admitted[req_id] = (block_ids, num_computed_tokens)
                    tainted.discard(req_id)
                    kept.pop(req_id, None)
            if index:
                for req_id in [r for r in entries if r in tainted]:
                    removed = self._remove_bad(req_id, entries.pop(req_id))
                    if req_id in self.loaders:
                        self.loaders[req_id].update(removed)
            self._remove_moved_onto(entries, copied_from)
            self._remove_readers(entries, admitted, tainted, kept, copied_from)
            if index:
                self._note_rewritten(output, entries, copied_from)
        self.readers = tainted - (loaders - readmitted)
        self.kv_cache_manager.rewind_num_cached_blocks(self.loaders)


class WithoutRecomputedKeptRollback(OtherFailedLoadWalk):
    """The guard, minus the seed-17 rule (see :class:`KeptEntriesStay`)."""

    walk_class = KeptEntriesStay


class ReadmittedLoadersStayLoaders(OtherReaders):
    """No loader admitted afresh in a later step is judged a reader there: a loader
    preempted (by a reset of the running requests) before its failed load's report, and
    resumed at once on its own load's entries, is taken for the loader only, and vLLM's
    truncation of the loader leaves the token that step sampled over the failed KV
    deliverable (the ``everything-async`` seed-2 soak finding)."""

    def mutated_readers(self) -> set[str]:
        return self.readers - self.loaders.keys()


class WithoutReadmittedReaders(OtherFailedLoadWalk):
    """The guard, minus the seed-2 rule (see :class:`ReadmittedLoadersStayLoaders`)."""

    walk_class = ReadmittedLoadersStayLoaders


RulesFactory = Callable[[Any], UncommittedPrefixCache]

#: Mutation name -> the rules it runs instead of the guard's.
MUTATIONS: dict[str, RulesFactory] = {
    "no-reader-rollback": WithoutReaderRollback,
    "no-dropped-step-rollback": WithoutDroppedStepRollback,
    "no-recomputed-kept-rollback": WithoutRecomputedKeptRollback,
    "no-readmitted-reader": WithoutReadmittedReaders,
}

#: What each mutation (and stock, for the zombie) must be caught on: a small scope.
MUTATION_SCOPES: dict[str, str] = {
    "stock": "ci",
    "no-reader-rollback": "sync-fcfs-recompute",
    "no-dropped-step-rollback": "async-fcfs-recompute",
    # The seed-17 window opens only where blocks of a step in flight are freed at once
    # (vLLM's deferred free off): see that scope's description.
    "no-recomputed-kept-rollback": "async-priority-unfenced",
    "no-readmitted-reader": "async-reset-loader",
}
