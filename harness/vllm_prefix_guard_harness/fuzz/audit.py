"""Rollback audit and ideal policy: which of the guard's rollbacks were needed?

:class:`RollbackAudit` is the guard's rules (a subclass of
:class:`~vllm_prefix_guard.rules.uncommitted.UncommittedPrefixCache` that calls every
rule it overrides unchanged and only looks: ``tests/harness/fuzz/test_diagnostics_observe.py``
proves a run's counters and trajectory equal the plain guard's) run against one fuzz
run's shadow-KV worker. Every entry the rules remove is classified against the shadow
KV *as it stands once the dispatched steps ran*: at the end of the latest step
dispatched when it was removed (a dispatched step is never cancelled, and a later one
may rewrite the block), or right away if that step already ran; an entry a preemption
takes out of the open step, at the end of that step.

- ``valid``: the block holds exactly the KV the key names, written since the registering
  request was last admitted: the rollback dropped good KV;
- ``never_written`` / ``wrong`` / ``failed_load``: a slot is empty, holds another prefix
  or KV computed over bad KV (poisoned), or the connector reported the block's load as
  failed (its content is then undefined): the rollback was needed;
- ``leftover``: the right bytes, but written before the registering request was last
  admitted, or for another request: an earlier tenant of the block (the same request
  before a preemption or a reset, or a twin with the same prefix) left them, and no step
  writes them again; vLLM may zero a block it hands out afresh, and the guard cannot see
  a block's past, so the rollback was needed (found by ``reset-async`` at three times its
  horizon, seed 950007, vLLM 0.33; a twin's state left in a reused state block by the
  soak of ``hybrid-partial-kv-load-async``, seed 8, vLLM 0.33). What a request computes
  over such bytes, read on a hit of an entry its own tenancy never wrote, counts as
  leftover too when rolled back, and the request as a reader of bad KV: the zeroed block
  would have made it wrong;
- ``stale``: the undo was a no-op (the block lost that registration since).

Counts are kept per rollback cause (the rule that removed the entry). Two more rows
close the loop: what each step *commits* (all of it must be valid, or a rollback was
missed), and whether each request the rules name a reader of bad KV counted wrong KV
as computed.

:class:`IdealPolicy` is the ``ideal`` fuzz mode, a policy of its own (it decides): the
guard with every removal and reader preemption filtered by the shadow KV, so exactly
what is wrong is removed. ``guard - ideal`` is then the guard's loss, and ``ideal -
stock`` what safety changed (schedule divergence: stock read bad KV where the guard
recomputed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.core.sched.output import SchedulerOutput

from vllm_prefix_guard.rules.block_pool import StepCacheEntries, UncommittedEntry
from vllm_prefix_guard.rules.failed_kv_loads import FailedKVLoads, admissions, blocks_read
from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache
from vllm_prefix_guard_harness.shadow_kv import ShadowState, ShadowWorker, TokenModel

# The rule that removed an entry, as the audit's rows name it.
PREEMPTED = "preempted"
LOADER = "kv_load_failure: loader, failing step"
LOADER_LATER = "kv_load_failure: loader, later step in flight"
READER = "kv_load_failure: reader, computed over bad KV"
DROPPED_STEP = "dropped_step"
ABANDONED_STEP = "abandoned_step"

VALID, NEVER_WRITTEN, WRONG, FAILED_LOAD, LEFTOVER, STALE, UNKNOWN = (
    "valid",
    "never_written",
    "wrong",
    "failed_load",
    "leftover",
    "stale",
    "unknown",
)
NEEDED = (NEVER_WRITTEN, WRONG, FAILED_LOAD, LEFTOVER)
# Rows that are not rollbacks.
COMMITTED = "(committed)"
READERS = "(readers of bad KV: counted wrong KV?)"
BAD = "bad"


@dataclass
class Registration:
    """One recorded registration: its key's request, prefix length and step."""

    key: Any  # held, so the id used to look it up stays unique
    block_id: int
    request_id: str | None
    model: TokenModel | None
    num_tokens: int
    step: int
    # The step that last admitted the registering request (new or resumed; -1: unknown).
    admitted: int = -1


@dataclass
class AuditCounts:
    """cause -> verdict -> entries (requests, for :data:`READERS`)."""

    by_cause: dict[str, Counter[str]] = field(default_factory=dict)
    # (cause, request, step, block, prefix length) of the first entries of the wrong
    # kind: valid ones rolled back, invalid ones committed.
    examples: list[tuple[str, str | None, int, int, int]] = field(default_factory=list)

    def add(self, cause: str, verdict: str, reg: Registration | None = None) -> None:
        self.by_cause.setdefault(cause, Counter())[verdict] += 1
        wrong_kind = verdict == VALID if cause != COMMITTED else verdict in NEEDED
        if wrong_kind and reg is not None and len(self.examples) < 50:
            self.examples.append((cause, reg.request_id, reg.step, reg.block_id, reg.num_tokens))

    @property
    def valid_rolled_back(self) -> int:
        """Entries undone although their KV was (or would be) right."""
        return sum(c[VALID] for cause, c in self.by_cause.items() if not cause.startswith("("))

    @property
    def invalid_committed(self) -> int:
        """Entries committed although their KV was wrong: missed rollbacks."""
        counter = self.by_cause.get(COMMITTED, Counter())
        return sum(counter[v] for v in NEEDED)

    @property
    def clean_readers_preempted(self) -> int:
        """Requests preempted as readers of bad KV that counted none as computed."""
        return self.by_cause.get(READERS, Counter())[VALID]

    def causes_text(self) -> str:
        """``cause n; ...`` for the causes that rolled back valid entries."""
        return "; ".join(
            f"{cause} {counter[VALID]}"
            for cause, counter in sorted(self.by_cause.items())
            if not cause.startswith("(") and counter[VALID]
        )

    def merge(self, other: AuditCounts) -> None:
        for cause, counter in other.by_cause.items():
            self.by_cause.setdefault(cause, Counter()).update(counter)
        self.examples.extend(other.examples[: max(0, 50 - len(self.examples))])


class RollbackAudit(UncommittedPrefixCache):
    """The guard's rules, classifying every removal and commit against a shadow-KV
    driver's worker. Each override calls the rule it overrides and only observes."""

    def __init__(self, scheduler: Any, driver: Any) -> None:
        super().__init__(scheduler.kv_cache_manager)
        self.scheduler = scheduler
        self.driver = driver
        self.block_size: int = driver.worker.block_size
        # Per KV-cache group (blocks_read walks every group of an admission).
        self.block_sizes = [
            manager.block_size for manager in self.kv_cache_manager.coordinator.single_type_managers
        ]
        self.counts = AuditCounts()
        self.step = 0  # index of the open (next) schedule() call
        self._step_of: dict[int, int] = {}  # id(output) -> step, until it executed
        self._step_of_dispatched: dict[int, int] = {}  # id(output) -> step, until committed
        self._executed: set[int] = set()
        # step -> [(cause, registration)] waiting for that step to run.
        self._pending: dict[int, list[tuple[str, Registration]]] = {}
        # step -> [(admission, model, block ids, computed tokens)] of readers to judge.
        self._readers: dict[
            int, list[tuple[tuple[str, int], TokenModel | None, list[int], int]]
        ] = {}
        # step -> (request, registration) for each block an admission of that step hit
        # under an entry of an earlier step still uncommitted: judged when the step runs.
        self._hits: dict[int, list[tuple[str, Registration]]] = {}
        # (request, step admitting it) whose hit read bytes the tenancy of the entry it
        # hit never wrote (see ``leftover``).
        self._unvouched_hits: set[tuple[str, int]] = set()
        # (id(key), block id) -> registration, until committed or removed. vLLM builds a
        # new key object per registration.
        self._regs: dict[tuple[int, int], Registration] = {}
        self._models: dict[str, TokenModel] = {}
        # step -> block ids its connector reported invalid.
        self._invalid_at: dict[int, set[int]] = {}
        # request -> the step that last admitted it (new or resumed).
        self._admitted_at: dict[str, int] = {}
        # The rule removing entries right now (set around each rule call).
        self.cause = ""
        worker = driver.worker
        execute = worker.execute

        def execute_and_classify(plan: Any) -> Any:
            worker.kv.step = step = self._step_of.get(id(plan.output), -1)
            self._judge_hits(step)
            result = execute(plan)
            self._on_executed(plan.output)
            return result

        worker.execute = execute_and_classify

    # -- the rules, observed -----------------------------------------------------------

    def begin_step(self) -> None:
        self.cause = ABANDONED_STEP
        super().begin_step()

    def end_step(self, scheduler_output: Any) -> None:
        super().end_step(scheduler_output)
        step = self.step
        key = id(scheduler_output)
        self._step_of[key] = self._step_of_dispatched[key] = step
        for admitted, _, _ in admissions(scheduler_output):
            self._admitted_at[admitted] = step
        self._note_hits(scheduler_output, step)
        for request_id, entries in (self._entries_of(scheduler_output) or {}).items():
            for entry in entries:
                self._register(request_id, entry, step)
        self.step += 1

    def rollback_preempted(self, req_id: str, num_written_tokens: int) -> None:
        self.cause = PREEMPTED
        super().rollback_preempted(req_id, num_written_tokens)

    @property
    def rollback_class(self) -> type[FailedKVLoads]:
        """The failed-load rollback the guard runs with these rules (``attach_guard``),
        observed: each removal tagged with its rule."""
        return AuditedFailedKVLoads

    def failed_loads_reported(self, scheduler_output: Any, invalid_block_ids: set[int]) -> None:
        """A connector's report names the blocks of that step's loads."""
        step = self._step_of_dispatched.get(id(scheduler_output))
        if step is not None:
            self._invalid_at.setdefault(step, set()).update(invalid_block_ids)

    def commit_step(self, scheduler_output: Any) -> None:
        """What the step of ``scheduler_output`` keeps (it ran already): all of it must
        be valid. Older steps still in flight are dropped first."""
        entries = self._entries_of(scheduler_output)
        self.cause = DROPPED_STEP
        super().commit_step(scheduler_output)
        if entries is not None:
            self._committed(scheduler_output, entries)

    def _entries_of(self, scheduler_output: Any) -> StepCacheEntries | None:
        """The record of the step of ``scheduler_output``, while it is in flight (keyed
        as the rules key it)."""
        record = self.step_id_to_entries.get(id(scheduler_output))
        return None if record is None else record[1]

    def remove_entry(self, req_id: str | None, entry: UncommittedEntry) -> bool:
        key, block, _ = entry
        # Entries of the open step, or moved into a step in flight after it was
        # dispatched (kept on preemption: written by the latest step in flight).
        cause = self.cause
        reg = self._regs.pop((id(key), block.block_id), None) or self._register(
            req_id, entry, self.step if cause == PREEMPTED else self.step - 1
        )
        self._regs.pop((id(key), block.block_id), None)
        index = self.kv_cache_manager.block_pool.cached_block_hash_to_block
        cached = block.block_hash is key or index.contain(key, block.block_id)
        removed = super().remove_entry(req_id, entry)
        # Judged as the block will stand once every dispatched step ran: a later step
        # in flight may rewrite it (a request vLLM rewound recomputes into blocks it
        # had loaded), and a hit after this removal would read that.
        judged_at = reg.step if cause == PREEMPTED else max(reg.step, self.step - 1)
        if not cached:
            self.counts.add(cause, STALE, reg)
        elif judged_at in self._executed:
            self.counts.add(cause, self.verdict(reg, rolled_back=True), reg)
        else:
            self._pending.setdefault(judged_at, []).append((cause, reg))
        return removed

    def preempting_readers(self, readers: set[str]) -> set[str]:
        """Note the readers of bad KV the rules will preempt, to judge them once their
        step ran; returns them (the ideal policy narrows them)."""
        manager = self.scheduler.kv_cache_manager
        running = {r.request_id for r in self.scheduler.running}
        for request_id in readers:
            request = self.scheduler.requests.get(request_id)
            if request is None or request_id not in running:
                continue
            self._readers.setdefault(self.step - 1, []).append(
                (
                    (request_id, self._admitted_at.get(request_id, -1)),
                    self._model(request_id),
                    list(manager.get_block_ids(request_id)[0]),
                    request.num_computed_tokens,
                )
            )
        if self.step - 1 in self._executed:
            self._judge_readers(self.step - 1)
        return readers

    def _committed(self, output: object, entries: StepCacheEntries) -> None:
        step = self._step_of_dispatched.pop(id(output), None)
        index = self.kv_cache_manager.block_pool.cached_block_hash_to_block
        for request_id, request_entries in entries.items():
            for entry in request_entries:
                key, block, _ = entry
                reg = self._regs.pop((id(key), block.block_id), None) or self._register(
                    request_id, entry, step if step is not None else self.step - 1
                )
                self._regs.pop((id(key), block.block_id), None)
                if not (block.block_hash is key or index.contain(key, block.block_id)):
                    self.counts.add(COMMITTED, STALE, reg)
                else:
                    self.counts.add(COMMITTED, self.verdict(reg), reg)

    # -- classification ----------------------------------------------------------------

    def _register(self, request_id: str | None, entry: UncommittedEntry, step: int) -> Registration:
        key, block, num_tokens = entry
        reg = Registration(
            key,
            block.block_id,
            request_id,
            self._model(request_id),
            num_tokens or 0,
            step,
            -1 if request_id is None else self._admitted_at.get(request_id, -1),
        )
        self._regs[(id(key), block.block_id)] = reg
        return reg

    def _model(self, request_id: str | None) -> TokenModel | None:
        if request_id is None:
            return None
        model = self._models.get(request_id)
        if model is None:
            request = self.scheduler.requests.get(request_id)
            model = self.driver.worker.models.get(request_id) or (
                TokenModel(request.prompt_token_ids) if request is not None else None
            )
            if model is not None:
                self._models[request_id] = model
        return model

    def registration(self, key: Any, block: Any) -> Registration | None:
        return self._regs.get((id(key), block.block_id))

    def _note_hits(self, scheduler_output: Any, step: int) -> None:
        """Note, for each admission of the step of ``scheduler_output``, the blocks it hit
        under an entry of an earlier step not yet committed (a copy-on-write hit reads
        the copy's source); committed entries were judged valid when committed."""
        hits = list(admissions(scheduler_output))
        if not hits:
            return
        on_block: dict[int, list[Registration]] = {}
        for reg in self._regs.values():
            if reg.step < step:
                on_block.setdefault(reg.block_id, []).append(reg)
        if not on_block:
            return
        sources = {
            copy.dst_block_id: copy.src_block_id
            for copy in getattr(scheduler_output, "kv_cache_block_copies", None) or ()
        }
        for request_id, block_ids, computed in hits:
            for block_id in blocks_read(block_ids, computed, self.block_sizes):
                for reg in on_block.get(sources.get(block_id, block_id), ()):
                    self._hits.setdefault(step, []).append((request_id, reg))

    def _judge_hits(self, step: int) -> None:
        """Before the step numbered ``step`` runs: its admissions that hit bytes the
        tenancy of the entry they hit never wrote (never written, wrong, or left there
        by an earlier tenant)."""
        for request_id, reg in self._hits.pop(step, ()):
            if reg.model is None or reg.num_tokens <= 0:
                continue
            if self._content_verdict(reg, self.driver.worker, rolled_back=True) != VALID:
                self._unvouched_hits.add((request_id, step))

    def _judge_readers(self, step: int) -> None:
        size = self.block_size
        slots = self.driver.kv.slots
        for admission, model, block_ids, computed in self._readers.pop(step, ()):
            bad = (
                admission in self._unvouched_hits
                or model is None
                or any(
                    (held := slots.get(block_ids[p // size])) is None
                    or held[p % size] != model.fingerprint(p)
                    for p in range(computed)
                )
            )
            self.counts.add(READERS, BAD if bad else VALID)

    def _on_executed(self, output: Any) -> None:
        step = self._step_of.pop(id(output), None)
        if step is None:
            return
        self._executed.add(step)
        for cause, reg in self._pending.pop(step, ()):
            self.counts.add(cause, self.verdict(reg, rolled_back=True), reg)
        self._judge_readers(step)

    def verdict(
        self, reg: Registration, worker: ShadowWorker | None = None, rolled_back: bool = False
    ) -> str:
        """The content of ``reg``'s block (in ``worker``, default the driver's) against
        the KV its key names, or in a state group the state it names; for a rollback,
        also whether its request's tenancy wrote it."""
        if reg.model is None or reg.num_tokens <= 0:
            return UNKNOWN
        if reg.block_id in self._invalid_at.get(reg.step, ()):
            return FAILED_LOAD
        worker = self.driver.worker if worker is None else worker
        verdict = self._content_verdict(reg, worker, rolled_back)
        if (
            verdict == VALID
            and rolled_back
            and (reg.request_id, reg.admitted) in self._unvouched_hits
        ):
            # Computed over bytes an earlier tenant left: right only by that chance.
            return LEFTOVER
        return verdict

    def _content_verdict(self, reg: Registration, worker: ShadowWorker, rolled_back: bool) -> str:
        """``reg``'s block against the KV (or state) its key names, by content alone."""
        assert reg.model is not None
        if worker.states:
            state = worker.state_of_group(get_group_id(reg.key))
            if state is not None:
                return state_verdict(state, reg, rolled_back)
        kv = worker.kv
        held = kv.slots.get(reg.block_id)
        if held is None:
            return NEVER_WRITTEN
        written_at, written_by = kv.written_at[reg.block_id], kv.written_by[reg.block_id]
        size = self.block_size
        verdict = VALID
        for position in range((reg.num_tokens - 1) // size * size, reg.num_tokens):
            offset = position % size
            if held[offset] is None:
                return NEVER_WRITTEN
            if held[offset] != reg.model.fingerprint(position):
                verdict = WRONG
            elif (
                verdict == VALID
                and rolled_back
                and not _this_tenancy(reg, written_at[offset], written_by[offset])
            ):
                verdict = LEFTOVER
        return verdict

    def finish(self) -> AuditCounts:
        """Close the run: entries of steps that never ran were never written."""
        for step in list(self._readers):
            self._judge_readers(step)
        for pending in self._pending.values():
            for cause, reg in pending:
                self.counts.add(cause, NEVER_WRITTEN, reg)
        self._pending.clear()
        self._hits.clear()
        return self.counts


class AuditedFailedKVLoads(FailedKVLoads):
    """The rules' failed-load rollback, each removal tagged with the part of the rule
    that made it (the walk itself is the base class's, unchanged)."""

    uncommitted: RollbackAudit

    def __init__(self, uncommitted: RollbackAudit) -> None:
        super().__init__(uncommitted)
        self._cause: str | None = None

    def roll_back(self, scheduler_output: SchedulerOutput, invalid_block_ids: set[int]) -> None:
        self.uncommitted.failed_loads_reported(scheduler_output, invalid_block_ids)
        super().roll_back(scheduler_output, invalid_block_ids)
        self.readers = self.uncommitted.preempting_readers(self.readers)

    def remove_loaders(
        self,
        scheduler_output: SchedulerOutput,
        entries: StepCacheEntries,
        invalid_block_ids: set[int],
    ) -> set[str]:
        self._cause = LOADER
        try:
            return super().remove_loaders(scheduler_output, entries, invalid_block_ids)
        finally:
            self._cause = None

    def remove_computed_from(self, entries: StepCacheEntries, req_id: str, num_tokens: int) -> None:
        self._cause = READER
        try:
            super().remove_computed_from(entries, req_id, num_tokens)
        finally:
            self._cause = None

    def remove_bad(self, req_id: str | None, entries: list[UncommittedEntry]) -> set[int]:
        # Called by the walk itself for a request tainted since an earlier step.
        self.uncommitted.cause = self._cause or (LOADER_LATER if req_id in self.loaders else READER)
        return super().remove_bad(req_id, entries)


def state_verdict(state: ShadowState, reg: Registration, rolled_back: bool) -> str:
    """A state group's entry: its block must hold the state after the prefix its key
    names (a state block is one snapshot, not per-token slots); for a rollback, written
    by the registering request's current tenancy (state blocks are not zeroed, so an
    earlier tenant's state for the same prefix can sit there: leftover bytes)."""
    assert reg.model is not None
    held = state.held.get(reg.block_id)
    if held is None:
        return NEVER_WRITTEN
    if held != reg.model.fingerprint(reg.num_tokens - 1):
        return WRONG
    block_id = reg.block_id
    if rolled_back and not _this_tenancy(
        reg, state.written_at[block_id], state.written_by.get(block_id)
    ):
        return LEFTOVER
    return VALID


def _this_tenancy(reg: Registration, written_at: int, written_by: str | None) -> bool:
    """Whether a write vouches for ``reg``: made for its request (a request with no
    name, a key moved by vLLM, is vouched by any) since that request was last admitted."""
    if written_at < reg.admitted:
        return False
    return reg.request_id is None or written_by == reg.request_id


class IdealPolicy(RollbackAudit):
    """The ``ideal`` mode: the guard with each removal and reader preemption filtered by
    the shadow KV, so exactly the entries whose KV is (or will be, once the dispatched
    steps ran) wrong are removed, and exactly the readers that count wrong KV as computed
    are preempted. Where the guard's decisions are exact the two runs are identical.

    The final content is predicted by executing the steps in flight on a fork of the
    shadow-KV worker (the fake connector knows which loads will fail).
    """

    def __init__(self, scheduler: Any, driver: Any) -> None:
        super().__init__(scheduler, driver)
        self.kept_entries = 0
        self.kept_readers = 0
        self._prediction_key: tuple[int, int] | None = None
        self._prediction: tuple[ShadowWorker, set[int]] = (driver.worker, set())

    def remove_entry(self, req_id: str | None, entry: UncommittedEntry) -> bool:
        if self.keeps(entry):
            return False
        return super().remove_entry(req_id, entry)

    def keeps(self, entry: UncommittedEntry) -> bool:
        """Whether the oracle keeps an entry the rules would remove (its KV is right)."""
        key, block, _ = entry
        reg = self.registration(key, block)
        if reg is not None and self.valid_final(reg):
            self.kept_entries += 1
            return True
        return False

    @property
    def rollback_class(self) -> type[FailedKVLoads]:
        return IdealFailedKVLoads

    def preempting_readers(self, readers: set[str]) -> set[str]:
        running = {r.request_id for r in self.scheduler.running} & readers
        keep = {r for r in running if not self.counts_wrong_kv(r)}
        self.kept_readers += len(keep)
        return super().preempting_readers(readers - keep)

    def _final(self) -> tuple[ShadowWorker, set[int]]:
        """The worker once every dispatched step ran (what its KV and state blocks then
        hold), and the blocks their loads leave invalid."""
        driver = self.driver
        worker: ShadowWorker = driver.worker
        key = (worker.steps_executed, len(driver.in_flight))
        if key == self._prediction_key:
            return self._prediction
        twin = worker.fork()
        invalid: set[int] = set()
        for plan in list(driver.in_flight):
            twin.kv.step = self._step_of.get(id(plan.output), -1)
            twin.execute(plan)
            invalid.update(b for load in plan.loads if load.fails for b in load.block_ids)
        self._prediction_key, self._prediction = key, (twin, invalid)
        return self._prediction

    def valid_final(self, reg: Registration) -> bool:
        final, invalid = self._final()
        if reg.step not in self._executed and reg.block_id in invalid:
            return False
        return self.verdict(reg, final, rolled_back=True) == VALID

    def counts_wrong_kv(self, request_id: str) -> bool:
        """Whether a running request counts KV as computed that is (or will be) wrong."""
        model = self._model(request_id)
        if model is None:
            return True
        slots = self._final()[0].kv.slots
        size = self.block_size
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        return any(
            (held := slots.get(block_ids[p // size])) is None
            or held[p % size] != model.fingerprint(p)
            for p in range(self.scheduler.requests[request_id].num_computed_tokens)
        )


class IdealFailedKVLoads(AuditedFailedKVLoads):
    """The failed-load rollback of the ideal policy: entries whose KV is right stay, and
    their blocks are not bad."""

    uncommitted: IdealPolicy

    def remove_bad(self, req_id: str | None, entries: list[UncommittedEntry]) -> set[int]:
        return super().remove_bad(
            req_id, [entry for entry in entries if not self.uncommitted.keeps(entry)]
        )
