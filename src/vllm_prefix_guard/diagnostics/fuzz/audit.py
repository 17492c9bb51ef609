"""Rollback audit and ideal policy: which of the guard's rollbacks were needed?

:class:`RollbackAudit` observes one guarded fuzz run's ledger (its public
:class:`~vllm_prefix_guard.ledger.LedgerObserver` hook) and shadow-KV worker. Every entry
the ledger undoes is classified against the shadow KV *as it stands once the dispatched
steps ran*: at the end of the latest step dispatched when it was undone (a dispatched step
is never cancelled, and a later one may rewrite the block), or right away if that step
already ran; an entry a preemption takes out of the open step, at the end of that step.

- ``valid``: the block holds exactly the KV the key names, written since the registering
  request was last admitted: the rollback dropped good KV;
- ``never_written`` / ``wrong`` / ``failed_load``: a slot is empty, holds another prefix
  or KV computed over bad KV (poisoned), or the connector reported the block's load as
  failed (its content is then undefined): the rollback was needed;
- ``leftover``: the right bytes, but written before the registering request was last
  admitted: an earlier tenant of the block (the same request before a preemption or a
  reset, with the same prefix) left them, and no step writes them again; vLLM may zero a
  block it hands out afresh, and the guard cannot see a block's past, so the rollback was
  needed (found by ``reset-async`` at three times its horizon, seed 950007, vLLM 0.33);
- ``stale``: the undo was a no-op (the block lost that registration since).

Counts are kept per rollback cause (the ledger path that undid the entry). Two more rows
close the loop: what each step *commits* (all of it must be valid, or a rollback was
missed), and whether each request the ledger names a reader of bad KV counted wrong KV
as computed.

:class:`IdealPolicy` is the ``ideal`` fuzz mode: the guard with every undo and reader
preemption filtered by the shadow KV, so exactly what is wrong is undone. ``guard -
ideal`` is then the guard's loss, and ``ideal - stock`` what safety changed (schedule
divergence: stock read bad KV where the guard recomputed).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from vllm_prefix_guard.diagnostics.shadow_kv import ShadowKV, ShadowWorker, TokenModel
from vllm_prefix_guard.ledger import PREEMPTED, Entry, StepBucket, StepLedger
from vllm_prefix_guard.recovery import admissions_of

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


class RollbackAudit:
    """A :class:`~vllm_prefix_guard.ledger.LedgerObserver` that classifies every undo
    and commit of one scheduler's ledger against a shadow-KV driver's worker."""

    def __init__(self, scheduler: Any, ledger: StepLedger, driver: Any) -> None:
        self.scheduler = scheduler
        self.ledger = ledger
        self.driver = driver
        self.block_size: int = driver.worker.block_size
        self.counts = AuditCounts()
        self.step = 0  # index of the open (next) schedule() call
        self._step_of: dict[int, int] = {}  # id(output) -> step, until it executed
        self._step_of_dispatched: dict[int, int] = {}  # id(output) -> step, until committed
        self._executed: set[int] = set()
        # step -> [(cause, registration)] waiting for that step to run.
        self._pending: dict[int, list[tuple[str, Registration]]] = {}
        # step -> [(model, block ids, computed tokens)] of readers to judge.
        self._readers: dict[int, list[tuple[TokenModel | None, list[int], int]]] = {}
        # (id(key), block id) -> registration, until committed or undone. vLLM builds a
        # new key object per registration.
        self._regs: dict[tuple[int, int], Registration] = {}
        self._models: dict[str, TokenModel] = {}
        # step -> block ids its connector reported invalid.
        self._invalid_at: dict[int, set[int]] = {}
        # request -> the step that last admitted it (new or resumed).
        self._admitted_at: dict[str, int] = {}
        ledger.observer = self
        worker = driver.worker
        execute = worker.execute

        def execute_and_classify(plan: Any) -> Any:
            worker.kv.step = self._step_of.get(id(plan.output), -1)
            result = execute(plan)
            self._on_executed(plan.output)
            return result

        worker.execute = execute_and_classify

    # -- LedgerObserver ----------------------------------------------------------------

    def step_dispatched(self, output: object, bucket: StepBucket) -> None:
        step = self.step
        self._step_of[id(output)] = self._step_of_dispatched[id(output)] = step
        for admitted, _, _ in admissions_of(output):
            self._admitted_at[admitted] = step
        for request_id, entries in bucket.by_request.items():
            for entry in entries:
                self._register(request_id, entry, step)
        self.step += 1

    def loads_failed(self, output: object, invalid_block_ids: set[int]) -> None:
        step = self._step_of_dispatched.get(id(output))
        if step is not None:
            self._invalid_at[step] = set(invalid_block_ids)

    def undoing(self, cause: str, request_id: str | None, entries: list[Entry]) -> list[Entry]:
        index = self.ledger.pool.cached_block_hash_to_block
        for entry in entries:
            key, block, _ = entry
            # Entries of the open step, or moved into a step in flight after it was
            # dispatched (kept on preemption: written by the latest step in flight).
            reg = self._regs.pop((id(key), block.block_id), None) or self._register(
                request_id, entry, self.step if cause == PREEMPTED else self.step - 1
            )
            self._regs.pop((id(key), block.block_id), None)
            # Judged as the block will stand once every dispatched step ran: a later step
            # in flight may rewrite it (a request vLLM rewound recomputes into blocks it
            # had loaded), and a hit after this undo would read that.
            judged_at = reg.step if cause == PREEMPTED else max(reg.step, self.step - 1)
            if not (block.block_hash is key or index.contain(key, block.block_id)):
                self.counts.add(cause, STALE, reg)
            elif judged_at in self._executed:
                self.counts.add(cause, self.verdict(reg, rolled_back=True), reg)
            else:
                self._pending.setdefault(judged_at, []).append((cause, reg))
        return entries

    def preempting_readers(self, readers: set[str]) -> set[str]:
        manager = self.scheduler.kv_cache_manager
        for request_id in readers:
            request = self.scheduler.requests.get(request_id)
            if request is None or request.request_id not in {
                r.request_id for r in self.scheduler.running
            }:
                continue
            self._readers.setdefault(self.step - 1, []).append(
                (
                    self._model(request_id),
                    list(manager.get_block_ids(request_id)[0]),
                    request.num_computed_tokens,
                )
            )
        if self.step - 1 in self._executed:
            self._judge_readers(self.step - 1)
        return readers

    def step_committed(self, output: object, bucket: StepBucket) -> None:
        """What the step of ``output`` keeps (it ran already): all of it must be valid."""
        step = self._step_of_dispatched.pop(id(output), None)
        index = self.ledger.pool.cached_block_hash_to_block
        for request_id, entries in bucket.by_request.items():
            for entry in entries:
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

    def _register(self, request_id: str | None, entry: Entry, step: int) -> Registration:
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

    def _judge_readers(self, step: int) -> None:
        size = self.block_size
        slots = self.driver.kv.slots
        for model, block_ids, computed in self._readers.pop(step, ()):
            bad = model is None or any(
                (held := slots.get(block_ids[p // size])) is None
                or held[p % size] != model.fingerprint(p)
                for p in range(computed)
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
        self, reg: Registration, kv: ShadowKV | None = None, rolled_back: bool = False
    ) -> str:
        """The content of ``reg``'s block (in ``kv``, default the driver's) against the KV
        its key names; for a rollback, also whether its request's tenancy wrote it."""
        if reg.model is None or reg.num_tokens <= 0:
            return UNKNOWN
        if reg.block_id in self._invalid_at.get(reg.step, ()):
            return FAILED_LOAD
        kv = self.driver.kv if kv is None else kv
        held = kv.slots.get(reg.block_id)
        if held is None:
            return NEVER_WRITTEN
        written_at = kv.written_at[reg.block_id]
        size = self.block_size
        verdict = VALID
        for position in range((reg.num_tokens - 1) // size * size, reg.num_tokens):
            if held[position % size] is None:
                return NEVER_WRITTEN
            if held[position % size] != reg.model.fingerprint(position):
                verdict = WRONG
            elif verdict == VALID and rolled_back and written_at[position % size] < reg.admitted:
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
        return self.counts


class IdealPolicy(RollbackAudit):
    """The ``ideal`` mode: the guard with each undo and reader preemption filtered by the
    shadow KV, so exactly the entries whose KV is (or will be, once the dispatched steps
    ran) wrong are undone, and exactly the readers that count wrong KV as computed are
    preempted. Where the guard's decisions are exact the two runs are identical.

    The final content is predicted by executing the steps in flight on a fork of the
    shadow-KV worker (the fake connector knows which loads will fail).
    """

    def __init__(self, scheduler: Any, ledger: StepLedger, driver: Any) -> None:
        super().__init__(scheduler, ledger, driver)
        self.kept_entries = 0
        self.kept_readers = 0
        self._cache_key: tuple[int, int] | None = None
        self._cache: tuple[ShadowKV, set[int]] = (ShadowKV(self.block_size), set())

    def undoing(self, cause: str, request_id: str | None, entries: list[Entry]) -> list[Entry]:
        undone = []
        for entry in entries:
            key, block, _ = entry
            reg = self.registration(key, block)
            if reg is not None and self.valid_final(reg):
                self.kept_entries += 1
            else:
                undone.append(entry)
        return super().undoing(cause, request_id, undone)

    def preempting_readers(self, readers: set[str]) -> set[str]:
        running = {r.request_id for r in self.scheduler.running} & readers
        keep = {r for r in running if not self.counts_wrong_kv(r)}
        self.kept_readers += len(keep)
        return super().preempting_readers(readers - keep)

    def _final(self) -> tuple[ShadowKV, set[int]]:
        """The KV once every dispatched step ran, and the blocks their loads leave invalid."""
        driver = self.driver
        worker: ShadowWorker = driver.worker
        key = (worker.steps_executed, len(driver.in_flight))
        if key == self._cache_key:
            return self._cache
        twin = worker.fork()
        invalid: set[int] = set()
        for plan in list(driver.in_flight):
            twin.kv.step = self._step_of.get(id(plan.output), -1)
            twin.execute(plan)
            invalid.update(b for load in plan.loads if load.fails for b in load.block_ids)
        self._cache_key, self._cache = key, (twin.kv, invalid)
        return self._cache

    def valid_final(self, reg: Registration) -> bool:
        kv, invalid = self._final()
        if reg.step not in self._executed and reg.block_id in invalid:
            return False
        return self.verdict(reg, kv, rolled_back=True) == VALID

    def counts_wrong_kv(self, request_id: str) -> bool:
        """Whether a running request counts KV as computed that is (or will be) wrong."""
        model = self._model(request_id)
        if model is None:
            return True
        slots = self._final()[0].slots
        size = self.block_size
        block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
        return any(
            (held := slots.get(block_ids[p // size])) is None
            or held[p % size] != model.fingerprint(p)
            for p in range(self.scheduler.requests[request_id].num_computed_tokens)
        )
