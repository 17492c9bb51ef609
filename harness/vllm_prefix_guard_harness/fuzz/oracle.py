"""The fuzzer's view of the shadow-KV oracle: per-step meters and invalid-hit accounting.

:class:`MeteredDriver` is the shadow-KV :class:`Driver` plus:

- *metering*: prefix-cache hit tokens, scheduled and loaded tokens. A request's hit is
  the tokens it starts with as computed when first scheduled, minus what the KV
  connector loads for it in that step (for an asynchronous load, the tokens it had when
  the load started): the local hit the scheduler acted on, which is what vLLM reports
  per request (``num_cached_tokens``, less connector tokens). Hits on
  resuming after a preemption are not added, so preemption churn does not inflate it;
- *invalid hits*: hit tokens whose KV was never written (or holds another prefix) when
  the first step ran (and apart, those of requests resuming after a preemption), and
  *bad admissions*: admissions, resumes included, that read such KV. Stock vLLM's hits
  include the former, the guard's cannot; each of the latter let stock skip computing
  tokens the guard computes, which can shift its schedule (and its preemptions) from
  there on. So the gaps between the two are explained, not just observed;
- *discarded reads*: a step that holds a block whose KV load failed (reported by that
  step, or by an earlier one after this step was dispatched) is not checked for the
  requests holding such a block, if they read wrong content. When the failure is
  reported vLLM finds those requests by block id
  (``_update_requests_with_invalid_blocks``), truncates or fails them and skips their
  output of the failing step; their reads there, and in steps dispatched before the
  report (including of KV they computed over the invalid blocks), are vLLM's known
  loss, alike with and without the guard, and not prefix-cache hits. (Under async
  scheduling vLLM keeps the token such a later in-flight step sampled: a vLLM bug
  outside prefix caching, not counted here; ``runner.awaits_dropped_output`` is its
  liveness twin.) A read of right content is checked as usual: a reported id can name
  a block that was freed and rewritten since (say, by a load that succeeded), and
  reading it is then no loss at all. Later steps are checked as usual.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from vllm_prefix_guard_harness.kv_events import KVEventReplay
from vllm_prefix_guard_harness.shadow_kv import Driver, ScheduledRead, ShadowKV, StepPlan


@dataclass
class FuzzKV(ShadowKV):
    """Shadow KV that attributes the bad reads of admitting steps to prefix-cache hits."""

    # id(read) -> whether it is its request's first admission, for reads that admit
    # their request (their start is its prefix-cache hit).
    admission_reads: dict[int, bool] = field(default_factory=dict)
    invalid_hit_tokens: int = 0
    invalid_resume_hit_tokens: int = 0
    bad_admissions: int = 0
    discarded_reads: int = 0

    def check_reads(
        self, step: int, read: ScheduledRead, skip_blocks: set[int], record: bool = True
    ) -> bool:
        if (
            skip_blocks
            and not skip_blocks.isdisjoint(read.block_ids[: -(-read.start // self.block_size)])
            and not super().check_reads(step, read, set(), record=False)
        ):
            if record:
                self.admission_reads.pop(id(read), None)
                self.discarded_reads += 1
            return False
        if not record or id(read) not in self.admission_reads:
            return super().check_reads(step, read, skip_blocks, record)
        first = self.admission_reads.pop(id(read))
        before = self.counts.total()
        clean = super().check_reads(step, read, skip_blocks, record)
        bad = self.counts.total() - before
        if bad:
            self.bad_admissions += 1
            if first:
                self.invalid_hit_tokens += bad
            else:
                self.invalid_resume_hit_tokens += bad
        return clean


class MeteredDriver(Driver):
    """The shadow-KV driver, tallying admissions, hits and scheduled tokens per step.

    It keeps no output history (``Driver.outputs``), so a soak's memory stays flat.
    """

    def __init__(
        self,
        scheduler: Any,
        depth: int,
        sample: Callable[[str, int], int] | None = None,
    ) -> None:
        super().__init__(scheduler, depth, sample)
        self.worker.kv = self.fuzz_kv = FuzzKV(self.worker.block_size)
        # With KV events on: a consumer replayed from them, checked after every step.
        self.events = KVEventReplay(scheduler) if KVEventReplay.enabled(scheduler) else None
        self.steps = 0
        self.request_hit_tokens = 0
        self.computed_tokens = 0
        self.loaded_tokens = 0
        # Digest of every step's decisions: who was scheduled for how many tokens, on
        # how many computed ones when admitted, and who was preempted.
        self.decisions = 0
        # ``decisions`` after each step, by step (the oracle's step numbers): where two
        # runs of one workload part.
        self.decision_history: list[int] = []
        # request id -> its num_preemptions when last admitted.
        self._admitted: dict[str, int] = {}
        # request id -> its local prefix-cache hit when the scheduler started an
        # asynchronous load for it: its hit, though it is first scheduled steps later.
        self._hit_before_load: dict[str, int] = {}

    @property
    def admitted(self) -> dict[str, int]:
        """Request id -> its ``num_preemptions`` when last admitted: whether its next
        admission counts its hit (state a search must tell apart)."""
        return self._admitted

    def schedule(self) -> Any:
        output = super().schedule()
        self.outputs.clear()
        self._observe(self.in_flight[-1])
        return output

    def complete(self) -> Any:
        plan = self.in_flight[0]
        try:
            result = super().complete()
            if self.events is not None:
                self.events.check()
            return result
        finally:
            # The oracle does not check every read (e.g. of a request whose load failed);
            # forget them all, so a later read reusing an id is not taken for one.
            for read in plan.reads:
                self.fuzz_kv.admission_reads.pop(id(read), None)

    def _observe(self, plan: StepPlan) -> None:
        self.steps += 1
        output = plan.output
        self.decisions = hash(
            (
                self.decisions,
                tuple(sorted(output.num_scheduled_tokens.items())),
                tuple(sorted((r.req_id, r.num_computed_tokens) for r in output.scheduled_new_reqs)),
                tuple(sorted(_resumed(output.scheduled_cached_reqs))),
                tuple(sorted(output.preempted_req_ids or ())),
            )
        )
        self.decision_history.append(self.decisions)
        self.computed_tokens += plan.output.total_num_scheduled_tokens
        loaded: dict[str, int] = {}
        for load in plan.loads:
            loaded[load.request_id] = loaded.get(load.request_id, 0) + load.num_tokens
            if load.steps and load.request_id not in self._admitted:
                hit = self._hit_before_load.get(load.request_id, load.start)
                self._hit_before_load[load.request_id] = min(hit, load.start)
        self.loaded_tokens += sum(loaded.values())
        requests = self.scheduler.requests
        for read in plan.reads:
            preemptions = requests[read.request_id].num_preemptions
            seen = self._admitted.get(read.request_id)
            if seen != preemptions:
                self._admitted[read.request_id] = preemptions
                first = seen is None
                if first:
                    hit = self._hit_before_load.pop(read.request_id, None)
                    if hit is None:
                        hit = read.start - loaded.get(read.request_id, 0)
                    self.request_hit_tokens += hit
                self.fuzz_kv.admission_reads[id(read)] = first


def _resumed(cached: Any) -> Iterator[tuple[str, int]]:
    """Requests a step resumes after a preemption among its cached ones, with the tokens
    they resume from (vLLM 0.34 resumes them among the new ones)."""
    from vllm_prefix_guard.rules.failed_kv_loads import resumed_req_ids

    resumed = resumed_req_ids(cached)
    if resumed:
        for request_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            if request_id in resumed:
                yield request_id, computed
