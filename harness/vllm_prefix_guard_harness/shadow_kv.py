"""The shadow-KV oracle: a fake worker that knows what every KV slot really holds.

Each executed step writes, into ``(block_id, offset)``, a fingerprint of the token
content at that position (a hash chained over the whole prefix, so equal fingerprints
mean equal KV). Before attention it checks every position each scheduled request
reads against the fingerprint the request expects there. A mismatch is a violation:
*never written* (the slot holds nothing) or *wrong content* (it holds another prefix).

The "model" is deterministic: the token after a prefix is a function of that prefix's
fingerprint, so the worker knows every request's tokens from its prompt alone and
what it returns as sampled is what vLLM appends. A caller may instead name each
request's token at each position (``sample``, as seeded sampling would: requests with
one prompt then diverge); the fingerprints follow whatever was sampled.

Within a step all writes (connector loads first, then computed tokens) happen before
any read, as in one forward pass; steps execute in dispatch order, as on one stream.
KV computed by a request that read wrong KV is itself wrong (*poisoned*): readers of it
see *wrong content*, which is how garbage propagates through a real model.

A hybrid model's state groups (Mamba2 / GDN layers, prefix caching in ``align`` mode) hold
one recurrent state per block instead of KV per token: :class:`ShadowState`. As vLLM's
runner does (``mamba_utils.preprocess_mamba``), a step starts from the state in the
request's block for its computed tokens (the block it last wrote, or for a new or resumed
request the block of its prefix hit) and writes the state after its last token into the
block for that position; a hit of ``h`` tokens thus resumes from whatever the block
registered for ``h`` holds. That read is bad unless the block holds exactly the state
after those ``h`` tokens: a wrong state corrupts everything the request computes after
it. State blocks are not zeroed on allocation: a never-written block holds whatever its
previous tenant left.

Speculative decoding (a scheduler with ``num_speculative_tokens``): the worker drafts
(:func:`draft_token`), a step keeps its drafts up to the first wrong one and samples a token
per kept draft and one after; a rejected draft's KV, and what follows it, is wrong content.
Its state is the one after its last kept token, and when kept drafts cross a state-block
boundary the state at the highest one goes into that boundary's block (vLLM's align-mode
postprocess). Under async scheduling a step is scheduled as if every draft of the step in
flight were kept; the runner moves it back by those it rejected, and so does this worker.
"""

from __future__ import annotations

import zlib
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from vllm_prefix_guard.selftest import model_runner_output
from vllm_prefix_guard_harness.factory import VOCAB_SIZE

NEVER_WRITTEN = "never_written"
WRONG_CONTENT = "wrong_content"
# A step started from a state block that never held a state, or held another prefix's.
STATE_NEVER_WRITTEN = "state_never_written"
STATE_WRONG_CONTENT = "state_wrong_content"
# A step read bad KV or state a report still pending at its dispatch excuses (vLLM learns
# at the report and must recompute), and its sampled token was delivered all the same.
OUTPUT_OVER_BAD_KV = "output_over_bad_kv"


# The token a request holds at a position past its prompt: ``sample(position)``.
Sample = Callable[[int], int]


class TokenModel:
    """Tokens and prefix fingerprints of one prompt's deterministic continuation.

    Past the prompt, the token at ``i`` is ``sample(i)`` if given, else the greedy
    :func:`next_token` of the prefix before it.
    """

    __slots__ = ("fingerprints", "sample", "tokens")

    def __init__(self, prompt: list[int], sample: Sample | None = None) -> None:
        self.tokens = list(prompt)
        self.fingerprints: list[int] = []
        self.sample = sample

    def fingerprint(self, position: int) -> int:
        fps, tokens = self.fingerprints, self.tokens
        if len(fps) <= position:
            previous = fps[-1] if fps else 0x5EED
            for i in range(len(fps), position + 1):
                if i >= len(tokens):
                    tokens.append(self._sampled(i))
                previous = hash((previous, tokens[i]))
                fps.append(previous)
        return fps[position]

    def token(self, position: int) -> int:
        """The token at ``position``: what the model samples there, past the prompt."""
        tokens = self.tokens
        if position >= len(tokens):
            self.fingerprint(position - 1)
            if position == len(tokens):
                tokens.append(self._sampled(position))
        return tokens[position]

    def _sampled(self, position: int) -> int:
        # Called with every token before ``position`` fingerprinted.
        if self.sample is not None:
            return self.sample(position)
        return next_token(self.fingerprints[position - 1])


def next_token(fingerprint: int) -> int:
    """The fake model's greedy choice after a prefix."""
    return fingerprint % (VOCAB_SIZE - 1) + 1


#: The share of draft tokens the fake drafter gets right (each one on its own; a draft is
#: accepted up to its first wrong token).
DRAFT_ACCEPTANCE = 0.6


def draft_token(model: TokenModel, request_id: str, position: int) -> int:
    """The fake drafter's guess at ``position`` (a pure function of the request and the
    position, so a replay drafts alike): the model's token there, or another one."""
    token = model.token(position)
    if zlib.crc32(f"{request_id}/{position}".encode()) % 1000 < DRAFT_ACCEPTANCE * 1000:
        return token
    return token % (VOCAB_SIZE - 1) + 1


@dataclass
class Violation:
    step: int
    request_id: str
    position: int
    block_id: int
    kind: str


@dataclass
class ScheduledRead:
    """One request's part of a step, captured when ``schedule()`` returned."""

    request_id: str
    model: TokenModel
    start: int
    num_tokens: int
    block_ids: list[int]
    samples: bool
    # Per state group of the worker: the request's blocks by position (block ``k`` is
    # for the state after ``(k + 1) * block size`` tokens; None: the null block).
    state_block_ids: list[list[int | None]] = field(default_factory=list)
    # Speculative decoding: the draft tokens scheduled (the last ``len(draft_ids)`` of
    # ``num_tokens``; -1: a placeholder the worker fills, under async scheduling), and
    # how many of them the step accepts (set when it runs).
    draft_ids: list[int] = field(default_factory=list)
    accepted: int = 0
    # The request's steps with drafts still in flight when this one was scheduled: under
    # async scheduling the scheduler counts their drafts as accepted, and the runner
    # moves this step back by the drafts they rejected (vLLM corrects the positions of a
    # step scheduled on optimistic computed tokens).
    earlier: list[ScheduledRead] = field(default_factory=list, repr=False, compare=False)
    # ``start`` as scheduled (``start`` is moved back when the step runs; a forked
    # worker may run the step first).
    scheduled_start: int = field(default=-1, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.scheduled_start = self.start

    @property
    def drafts_start(self) -> int:
        """The position of the step's first draft: one past its own tokens."""
        return self.start + self.num_tokens - len(self.draft_ids)

    @property
    def valid_end(self) -> int:
        """One past the last position whose KV the step computes right: its tokens but
        the drafts it rejects."""
        return self.drafts_start + self.accepted

    def verify_drafts(self) -> None:
        """Accept the drafts up to the first that is not the model's token (a
        placeholder is the fake drafter's guess)."""
        accepted = 0
        for offset, token in enumerate(self.draft_ids):
            position = self.drafts_start + offset
            if token < 0:
                token = draft_token(self.model, self.request_id, position)
            if token != self.model.token(position):
                break
            accepted += 1
        self.accepted = accepted

    def sampled(self) -> list[int]:
        """What the step samples: a token per accepted draft, and one after them."""
        end = self.valid_end
        return [self.model.token(position) for position in range(end - self.accepted, end + 1)]


@dataclass
class StepPlan:
    output: Any
    reads: list[ScheduledRead]
    loads: list[Any]
    # How many load-failure reports the worker had made when this step was scheduled.
    reports_before: int = 0
    # Requests whose bad reads in this step a pending report excused, but for those whose
    # own load failed (set when executed): their sampled tokens must not be delivered.
    excused: set[str] = field(default_factory=set)


@dataclass
class ShadowKV:
    """Slot contents, what has been verified of them, and violations.

    Verification is remembered, so a request's reads cost O(what changed) per step, not
    O(its prefix): per ``(request, block index)``, the block and its *version* and how
    many leading positions held the right content; per request, the ids of its leading
    whole blocks all verified so (its *verified prefix*). A block's version moves, and
    the verified prefixes holding it are dropped, whenever a written slot's content
    changes; a first write into an empty slot cannot touch anything verified.
    Remembered results are only ever facts about unchanged slots, so reads are judged
    exactly as if every position were checked each time.
    """

    block_size: int
    slots: dict[int, list[int | None]] = field(default_factory=dict)
    versions: dict[int, int] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)
    # (request_id, block index) -> (block_id, version, positions verified)
    _verified: dict[tuple[str, int], tuple[int, int, int]] = field(default_factory=dict)
    # request_id -> ids of its leading whole blocks, each verified, none changed since
    _prefix: dict[str, list[int]] = field(default_factory=dict)
    # block_id -> requests whose verified prefix holds it
    _watchers: dict[int, set[str]] = field(default_factory=dict)
    # The step being executed, as the caller numbers steps (-1: none), and per slot the
    # step that last wrote it and for which request: who vouches for a slot's content
    # (the rollback audit tells a slot written for a block's current tenant from bytes
    # an earlier tenant left there).
    step: int = -1
    written_at: dict[int, list[int]] = field(default_factory=dict)
    written_by: dict[int, list[str | None]] = field(default_factory=dict)

    def record(self, violation: Violation) -> None:
        """Count ``violation``; keep the first hundred as examples."""
        self.counts[violation.kind] += 1
        if len(self.violations) < 100:
            self.violations.append(violation)

    def write(
        self, block_id: int, offset: int, fingerprint: int, writer: str | None = None
    ) -> None:
        slots = self.slots.get(block_id)
        if slots is None:
            slots = self.slots[block_id] = [None] * self.block_size
            self.written_at[block_id] = [-1] * self.block_size
            self.written_by[block_id] = [None] * self.block_size
        self.written_at[block_id][offset] = self.step
        self.written_by[block_id][offset] = writer
        held = slots[offset]
        if held != fingerprint:
            slots[offset] = fingerprint
            if held is not None:  # content changed: what was verified of it no longer holds
                self.versions[block_id] = self.versions.get(block_id, 0) + 1
                watchers = self._watchers.pop(block_id, None)
                if watchers:
                    for request_id in watchers:
                        self._prefix.pop(request_id, None)

    def check_reads(
        self, step: int, read: ScheduledRead, skip_blocks: set[int], record: bool = True
    ) -> bool:
        """Check positions ``[0, read.start)``: the KV this request attends over.

        Wrong content in ``skip_blocks`` (failed loads vLLM was told of: it discards the
        affected outputs) is not a violation, but still makes the read unclean. Right
        content there is a clean read: the id may name a block rewritten since, e.g.
        reused by a load that succeeded. With ``record=False`` nothing is counted and the
        check stops at the first wrong position.

        Returns:
            Whether every read position held the expected content.
        """
        size = self.block_size
        request_id, block_ids, start = read.request_id, read.block_ids, read.start
        num_blocks = -(-start // size)
        verified = self._verified
        prefix = self._prefix.get(request_id)
        first = 0
        if prefix is not None and len(prefix) <= num_blocks and block_ids[: len(prefix)] == prefix:
            first = len(prefix)
        whole = first  # leading whole blocks known to hold the right content
        clean_read = True
        if start:
            read.model.fingerprint(start - 1)
        expected = read.model.fingerprints
        for index in range(first, num_blocks):
            block_id = block_ids[index]
            upto = min(size, start - index * size)
            version = self.versions.get(block_id, 0)
            key = (request_id, index)
            seen = verified.get(key)
            begin = 0
            if seen is not None and seen[0] == block_id and seen[1] == version:
                begin = seen[2]
            clean = True
            if begin < upto:
                skipped = block_id in skip_blocks
                slots = self.slots.get(block_id)
                for offset in range(begin, upto):
                    position = index * size + offset
                    held = None if slots is None else slots[offset]
                    if held == expected[position]:
                        continue
                    clean = False
                    if skipped or not record:
                        break
                    kind = NEVER_WRITTEN if held is None else WRONG_CONTENT
                    self.record(Violation(step, request_id, position, block_id, kind))
                if clean:
                    verified[key] = (block_id, version, upto)
            if clean and whole == index and upto == size:
                whole += 1
            clean_read &= clean
            if not clean_read and not record:
                break
        if whole > first:
            self._prefix[request_id] = block_ids[:whole]
            watchers = self._watchers
            for block_id in block_ids[first:whole]:
                readers = watchers.get(block_id)
                if readers is None:
                    watchers[block_id] = {request_id}
                else:
                    readers.add(request_id)
        return clean_read


@dataclass
class ShadowState:
    """What each block of one align-mode state group holds, and where each request's
    next step starts from (the runner's ``mamba_state_idx``)."""

    group: int
    block_size: int
    index: int = 0  # this group's place in ScheduledRead.state_block_ids
    # block_id -> fingerprint of the prefix whose state it holds (poisoned: wrong state)
    held: dict[int, int] = field(default_factory=dict)
    # request_id -> position of the block its last step wrote
    last_written: dict[str, int] = field(default_factory=dict)
    # block_id -> the step that last wrote it, and for which request (the audit tells
    # bytes a block's earlier tenant left from a write of the current one)
    written_at: dict[int, int] = field(default_factory=dict)
    written_by: dict[int, str] = field(default_factory=dict)
    # Steps that started from a state another request wrote (a prefix hit), all checked.
    resumed_from_hits: int = 0
    # States at a block boundary that accepted drafts crossed, copied into its block.
    boundary_copies: int = 0

    def forget(self, request_ids: Any) -> None:
        """The runner drops preempted and finished requests: a resumed request starts
        again from the block of its prefix hit."""
        for request_id in request_ids or ():
            self.last_written.pop(request_id, None)

    def read(self, read: ScheduledRead) -> tuple[int | None, int | None, bool]:
        """``(block read, what it held, whether that is the state the step needs)`` for
        ``read``'s step; ``(None, None, True)`` when it starts from a fresh state."""
        if not read.start:
            return None, None, True
        if read.request_id not in self.last_written:
            self.resumed_from_hits += 1
        block_id = self.block_read(read)
        held = None if block_id is None else self.held.get(block_id)
        return block_id, held, held == read.model.fingerprint(read.start - 1)

    def block_read(self, read: ScheduledRead) -> int | None:
        """The block ``read``'s step starts from: the one its last step wrote, else (new or
        resumed) the block of its prefix hit; None for a fresh state or the null block."""
        if not read.start:
            return None
        blocks = read.state_block_ids[self.index]
        position = self.last_written.get(read.request_id)
        if position is None:
            position = (read.start - 1) // self.block_size
        return blocks[position] if position < len(blocks) else None

    def position_written(self, read: ScheduledRead) -> int:
        """The position of the block ``read``'s step writes the state after its last
        token into (the last draft it accepts)."""
        return -(-read.valid_end // self.block_size) - 1

    def block_written(self, read: ScheduledRead) -> int | None:
        return read.state_block_ids[self.index][self.position_written(read)]

    def write(self, read: ScheduledRead, poison: bool, step: int) -> None:
        """The state after ``read``'s last token, into the block for that position, by the
        step numbered ``step``."""
        position = self.position_written(read)
        block_id = read.state_block_ids[self.index][position]
        assert block_id is not None, "vLLM gave the step's state no block"
        self._put(block_id, read, read.valid_end, poison, step)
        self.last_written[read.request_id] = position
        # Accepted drafts that cross a block boundary: the runner copies the state at the
        # highest boundary crossed into that boundary's block (vLLM's align-mode
        # postprocess; a step without drafts ends on its own boundary or short of one).
        boundary = read.valid_end // self.block_size * self.block_size
        if read.draft_ids and read.drafts_start <= boundary:
            boundary_block = read.state_block_ids[self.index][boundary // self.block_size - 1]
            if boundary < read.valid_end and boundary_block is not None:
                self._put(boundary_block, read, boundary, poison, step)
                self.boundary_copies += 1

    def _put(
        self, block_id: int, read: ScheduledRead, tokens: int, poison: bool, step: int
    ) -> None:
        """The state after ``read``'s first ``tokens`` tokens, into ``block_id``."""
        fingerprint = read.model.fingerprint(tokens - 1)
        self.held[block_id] = poisoned(fingerprint) if poison else fingerprint
        self.written_at[block_id] = step
        self.written_by[block_id] = read.request_id

    def load(self, block_id: int, fingerprint: int, step: int, loader: str) -> None:
        """A KV connector loaded the state of the prefix ``fingerprint`` names into
        ``block_id`` for ``loader``, in the step numbered ``step``."""
        self.held[block_id] = fingerprint
        self.written_at[block_id] = step
        self.written_by[block_id] = loader

    def copy(self, source: int, destination: int) -> None:
        """The runner copies block ``source`` into ``destination`` before the step's
        forward pass (vLLM 0.33+: a Mamba partial hit's copy-on-write,
        ``SchedulerOutput.kv_cache_block_copies``)."""
        if source in self.held:
            self.held[destination] = self.held[source]
            self.written_at[destination] = self.written_at[source]
            writer = self.written_by.get(source)
            if writer is None:
                self.written_by.pop(destination, None)
            else:
                self.written_by[destination] = writer
        else:
            self.held.pop(destination, None)
            self.written_at.pop(destination, None)
            self.written_by.pop(destination, None)


def poisoned(fingerprint: int) -> int:
    """What a slot holds when its KV was computed over wrong KV: never the right content."""
    return ~fingerprint


class ShadowWorker:
    """Executes scheduler outputs against a :class:`ShadowKV` and builds their results.

    ``sample(request_id, position)``, if given, is each request's token past its prompt
    (see :class:`TokenModel`); by default the greedy fake model's.
    """

    def __init__(self, scheduler: Any, sample: Callable[[str, int], int] | None = None) -> None:
        self.scheduler = scheduler
        # The oracle follows the first KV-cache group (full attention); on a hybrid model
        # the scheduler's own block size is the LCM of every group's.
        groups = scheduler.kv_cache_config.kv_cache_groups
        self.block_size: int = groups[0].kv_cache_spec.block_size
        self.kv = ShadowKV(self.block_size)
        state_groups = [
            group
            for group, spec in enumerate(g.kv_cache_spec for g in groups)
            if getattr(spec, "mamba_cache_mode", None) == "align"
        ]
        self.states = [
            ShadowState(group, groups[group].kv_cache_spec.block_size, index)
            for index, group in enumerate(state_groups)
        ]
        self.models: dict[str, TokenModel] = {}
        self.sample = sample
        self.steps_executed = 0
        # (invalid block ids, requests whose load failed) per executed step that had any.
        self.failure_reports: list[tuple[set[int], set[str]]] = []
        # request id -> how many reports existed when a step preempted it: a preempted
        # request starts over (its own new loads, or hits the oracle checks block by
        # block), so the reports before that no longer make its later reads a known loss.
        self.restarted_at: dict[str, int] = {}
        # Asynchronous connector loads under way: (the step whose output reports it, load).
        self.receiving: list[tuple[int, Any]] = []

    def lost_by(self, index: int) -> set[str]:
        """The requests whose reads report ``index`` still makes a known loss: those
        whose load failed, unless a step preempted them since (they started over)."""
        return {
            request_id
            for request_id in self.failure_reports[index][1]
            if self.restarted_at.get(request_id, 0) <= index
        }

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def state_of_group(self, group: int) -> ShadowState | None:
        """The state group ``group`` of the KV-cache config, if it is one."""
        for state in self.states:
            if state.group == group:
                return state
        return None

    def fork(self) -> ShadowWorker:
        """A copy to execute steps on without touching this worker: what the KV will hold
        once the steps in flight ran (the rollback audit's ideal policy asks)."""
        twin = ShadowWorker(self.scheduler, self.sample)
        twin.kv.slots = {block: list(slots) for block, slots in self.kv.slots.items()}
        twin.kv.versions = dict(self.kv.versions)
        twin.kv.written_at = {block: list(at) for block, at in self.kv.written_at.items()}
        twin.kv.written_by = {block: list(by) for block, by in self.kv.written_by.items()}
        twin.states = [
            replace(
                state,
                held=dict(state.held),
                last_written=dict(state.last_written),
                written_at=dict(state.written_at),
                written_by=dict(state.written_by),
            )
            for state in self.states
        ]
        twin.models = self.models
        twin.steps_executed = self.steps_executed
        twin.failure_reports = list(self.failure_reports)
        twin.restarted_at = dict(self.restarted_at)
        twin.receiving = list(self.receiving)
        return twin

    def plan(self, output: Any) -> StepPlan:
        """Capture what ``output`` will do, right after ``schedule()`` returned it."""
        sched = self.scheduler
        managers = sched.kv_cache_manager.coordinator.single_type_managers
        reads = []
        drafts = output.scheduled_spec_decode_tokens
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            request = sched.requests[request_id]
            model = self.models.get(request_id)
            if model is None:
                sample = None if self.sample is None else partial(self.sample, request_id)
                model = self.models[request_id] = TokenModel(request.prompt_token_ids, sample)
            reads.append(
                ScheduledRead(
                    request_id,
                    model,
                    request.num_computed_tokens - num_tokens,
                    num_tokens,
                    list(sched.kv_cache_manager.get_block_ids(request_id)[0]),
                    not request.is_prefill_chunk,
                    [
                        [
                            None if block.is_null else block.block_id
                            for block in managers[state.group].req_to_blocks[request_id]
                        ]
                        for state in self.states
                    ],
                    list(drafts.get(request_id, ())),
                )
            )
        meta = output.kv_connector_metadata
        loads = list(getattr(meta, "loads", ()) or ())
        for load in loads:  # an asynchronous loader is not scheduled in its load's step
            if load.request_id not in self.models:
                sample = None if self.sample is None else partial(self.sample, load.request_id)
                prompt = sched.requests[load.request_id].prompt_token_ids
                self.models[load.request_id] = TokenModel(prompt, sample)
        return StepPlan(output, reads, loads, len(self.failure_reports))

    def _write_computed(self, read: ScheduledRead, poison: bool) -> None:
        """The KV of ``read``'s tokens; a rejected draft's, and what follows it, is
        computed for other tokens than the request's (never the right content)."""
        size, block_ids, write = self.block_size, read.block_ids, self.kv.write
        writer = read.request_id
        end = read.start + read.num_tokens
        valid_end = read.valid_end
        read.model.fingerprint(end - 1)
        fingerprints = read.model.fingerprints
        for position in range(read.start, end):
            fingerprint = fingerprints[position]
            write(
                block_ids[position // size],
                position % size,
                poisoned(fingerprint) if poison or position >= valid_end else fingerprint,
                writer,
            )

    def _blocks_written(self, reads: list[ScheduledRead]) -> set[int]:
        """The KV and state blocks ``reads`` write (or were to write)."""
        blocks: set[int] = set()
        size = self.block_size
        for read in reads:
            if read.num_tokens:
                first, last = read.start // size, (read.start + read.num_tokens - 1) // size
                blocks.update(read.block_ids[first : last + 1])
            for state in self.states:
                block_id = state.block_written(read)
                if block_id is not None:
                    blocks.add(block_id)
        return blocks

    def _grow_reports(
        self,
        plan: StepPlan,
        pending: range,
        excused: set[str],
        copied_from: dict[int, int],
    ) -> None:
        """Requests of ``excused`` read wrong KV or state only where a report still pending
        when their step was dispatched excuses it (a known loss): what they write in the
        step is computed over it, and is that report's known loss too. With three steps in
        flight, such a reader's next step (dispatched before the report as well) reads it;
        vLLM learns at the report, and the steps dispatched after it are judged as usual.
        Each reader's writes join the reports whose blocks it attended over or started
        from (every pending report, for a reader tainted only by a same-step sharer)."""
        size = self.block_size
        reports = [self.failure_reports[index][0] for index in pending]
        for read in plan.reads:
            if read.request_id not in excused:
                continue
            attended = set(read.block_ids[: -(-read.start // size)])
            for state in self.states:
                block_id = state.block_read(read)
                if block_id is not None:
                    attended.update((block_id, copied_from.get(block_id, block_id)))
            written = self._blocks_written([read])
            sources = [blocks for blocks in reports if not attended.isdisjoint(blocks)]
            for blocks in sources or reports:
                blocks.update(written)

    def _read_states(
        self,
        step: int,
        plan: StepPlan,
        known_failed: set[int],
        copied_from: dict[int, int],
        charged: set[str],
    ) -> set[str]:
        """Check the state each request of ``plan`` starts from, in every state group,
        before the step writes any (the runner copies it into place before the forward
        pass); return the requests that started from a wrong one. A wrong state in a
        block of ``known_failed``, or copied in this step from one (``copied_from``:
        destination -> source), is a known loss: not counted. Requests whose wrong state
        was counted go into ``charged``."""
        bad: set[str] = set()
        output = plan.output
        for state in self.states:
            state.forget(output.preempted_req_ids)
            state.forget(output.finished_req_ids)
            for read in plan.reads:
                block_id, held, right = state.read(read)
                if right:
                    continue
                bad.add(read.request_id)
                if block_id is not None and (
                    block_id in known_failed or copied_from.get(block_id) in known_failed
                ):
                    continue
                kind = STATE_NEVER_WRITTEN if held is None else STATE_WRONG_CONTENT
                self.kv.record(Violation(step, read.request_id, read.start, block_id or -1, kind))
                charged.add(read.request_id)
        return bad

    def execute(self, plan: StepPlan) -> Any:
        """Write, then check reads; return the step's ``ModelRunnerOutput``."""
        from vllm.v1.outputs import KVConnectorOutput

        step = self.steps_executed
        self.steps_executed += 1
        for request_id in plan.output.preempted_req_ids or ():
            self.restarted_at[request_id] = len(self.failure_reports)
        size = self.block_size
        for read in plan.reads:
            if read.earlier:
                rejected = sum(len(e.draft_ids) - e.accepted for e in read.earlier)
                read.start = read.scheduled_start - rejected
            if read.draft_ids:
                read.verify_drafts()
        invalid: set[int] = set()
        failed_requests: set[str] = set()
        for load in plan.loads:
            if load.steps:
                self.receiving.append((step + load.steps - 1, load))
            elif load.fails:
                invalid.update(load.block_ids)
                failed_requests.add(load.request_id)
            else:
                self._load(load, step)
        if invalid:
            # A copy: the report grows below (what the failing request computes), and
            # `invalid` goes to vLLM in this step's output, which must not.
            self.failure_reports.append((set(invalid), failed_requests))
        # Failed loads reported after this step was dispatched: vLLM learns of them at
        # the report and recomputes; reads of those blocks, and every read of the request
        # whose load failed, are its known loss in this step, not a prefix-cache hit. So
        # is what that request computes over them while its report is pending (the
        # scheduler could not know at dispatch): a same-step sharer reads it as it reads
        # the failed block itself, and must recompute (vLLM truncates the holders of an
        # invalid block, the guard preempts every reader of a bad block).
        known_failed: set[int] = set()
        known_lost: set[str] = set()
        pending = range(plan.reports_before, len(self.failure_reports))
        for index in pending:
            blocks, requests = self.failure_reports[index][0], self.lost_by(index)
            for read in plan.reads:
                if read.request_id in requests and read.num_tokens:
                    first, last = read.start // size, (read.start + read.num_tokens - 1) // size
                    blocks.update(read.block_ids[first : last + 1])
            known_failed |= blocks
            known_lost |= requests
        # Block copies run before the forward pass (a Mamba partial hit's copy-on-write);
        # only state groups ask for them.
        copied_from: dict[int, int] = {}
        for source, destination in getattr(plan.output, "kv_cache_block_copies", None) or ():
            copied_from[destination] = source
            for state in self.states:
                state.copy(source, destination)
            # A copy of what a pending report excuses is that report's known loss too (a
            # checkpoint moved onto it, read by a step dispatched before the report).
            for index in pending:
                blocks = self.failure_reports[index][0]
                if source in blocks:
                    blocks.add(destination)
                    known_failed.add(destination)
        charged: set[str] = set()  # requests with a bad read counted in this step
        bad_state = self._read_states(step, plan, known_failed, copied_from, charged)
        for read in plan.reads:
            self._write_computed(read, poison=False)
        # KV of a token is computed from attention over its prefix (from the second
        # layer on): a request that read wrong KV writes wrong KV, and so may a request
        # reading that in the same step. Mark writers of bad reads until nothing changes.
        tainted: set[str] = set()
        while True:
            bad = {
                read.request_id
                for read in plan.reads
                if read.request_id not in tainted
                and (
                    read.request_id in known_lost
                    or read.request_id in bad_state
                    or not self.kv.check_reads(step, read, known_failed, record=False)
                )
            }
            if not bad:
                break
            tainted |= bad
            for read in plan.reads:
                if read.request_id in bad:
                    self._write_computed(read, poison=True)
        if tainted:  # else every read was clean, and nothing was written since
            for read in plan.reads:
                if read.request_id not in known_lost:
                    counted = self.kv.counts.total()
                    self.kv.check_reads(step, read, known_failed)
                    if self.kv.counts.total() != counted:
                        charged.add(read.request_id)
            # The requests whose own load failed are vLLM's to recover (it truncates them;
            # under async scheduling it still delivers the token of their step in flight,
            # stock and guard alike: outside prefix caching, not judged here).
            plan.excused = tainted - known_lost - charged
            if plan.excused:
                self._grow_reports(plan, pending, plan.excused, copied_from)
        for state in self.states:
            for read in plan.reads:
                state.write(read, poison=read.request_id in tainted, step=step)
        received, failed_received = self._receive(step, invalid)
        req_ids = [read.request_id for read in plan.reads]
        sampled = [read.sampled() if read.samples else [] for read in plan.reads]
        connector_output = None
        if invalid or received:
            # Named only when a load failed as a whole: an older KVConnectorOutput has no
            # failed_recving (capabilities.failed_loads_unreported: not run there).
            by_request = {"failed_recving": failed_received} if failed_received else {}
            connector_output = KVConnectorOutput(
                finished_recving=received or None, invalid_block_ids=invalid, **by_request
            )
        return model_runner_output(
            req_ids,
            sampled_token_ids=sampled,
            kv_connector_output=connector_output,
        )

    def _load(self, load: Any, step: int) -> None:
        """Perform ``load``: its KV, and the state after its last token in each state
        group it names (the step numbered ``step`` vouches for them)."""
        model, size = self.models[load.request_id], self.block_size
        for position in range(load.start, load.start + load.num_tokens):
            block_id = load.block_ids[position // size - load.start // size]
            self.kv.write(block_id, position % size, model.fingerprint(position), load.request_id)
        if load.state_blocks:
            fingerprint = model.fingerprint(load.start + load.num_tokens - 1)
            for group, block_id in load.state_blocks:
                state = self.state_of_group(group)
                if state is not None:
                    state.load(block_id, fingerprint, step, load.request_id)

    def _receive(self, step: int, invalid: set[int]) -> tuple[set[str], set[str]]:
        """Finish the asynchronous loads due at ``step``: ``(the requests whose loads are
        done, those whose load failed as a whole)``; the ids of blocks that failed alone go
        into ``invalid``. No step read those blocks (vLLM registers an asynchronous load's
        blocks only once it is reported done), so unlike a synchronous failure this is no
        known loss: every later read of them is checked."""
        due = [load for at, load in self.receiving if at <= step]
        if not due:
            return set(), set()
        self.receiving = [(at, load) for at, load in self.receiving if at > step]
        received: set[str] = set()
        failed: set[str] = set()
        for load in due:
            received.add(load.request_id)
            if not load.fails:
                self._load(load, step)
            elif load.by_request:
                failed.add(load.request_id)
            else:
                invalid.update(load.block_ids)
        return received, failed


class Driver:
    """Steps a real scheduler like ``EngineCore`` does, with up to ``depth`` steps in flight.

    ``depth=1`` is ``EngineCore.step``; ``depth=2`` is ``step_with_batch_queue`` under
    async scheduling: the next ``schedule()`` runs before the previous step's update.
    Aborts are applied just before an update, where ``EngineCore`` processes them.

    vLLM's runners compute every request of a dispatched step, aborted or not (a request
    leaves the input batch only when a later step lists it as finished); so does this
    worker, and the guard assumes it.

    The scheduler's own calls go through :meth:`call_schedule` and :meth:`call_update`
    only, so a subclass can time (or count) them alone, with the worker and this loop's
    bookkeeping outside (the benchmarks do).
    """

    def __init__(
        self,
        scheduler: Any,
        depth: int = 1,
        sample: Callable[[str, int], int] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.worker = ShadowWorker(scheduler, sample)
        self.depth = depth
        self.in_flight: deque[StepPlan] = deque()
        self.pending_aborts: list[str] = []
        self.outputs: list[Any] = []
        # Cache efficiency as vLLM reports it (PrefixCacheStats), summed over the run;
        # requests resuming after a preemption are counted apart (preempted_*).
        self.hit_tokens = 0
        self.query_tokens = 0
        self.preempted_hit_tokens = 0
        self.preempted_query_tokens = 0
        self.scheduled_tokens = 0
        self.preemptions = 0
        # Digest of every step's shape (tokens scheduled, requests scheduled): equal
        # digests mean two runs took the same trajectory.
        self.trajectory = 0

    @property
    def kv(self) -> ShadowKV:
        return self.worker.kv

    def add(self, request: Any) -> None:
        self.scheduler.add_request(request)

    def abort(self, request_id: str, at_once: bool = False) -> None:
        """Abort ``request_id`` at the next update, or ``at_once``: before the next
        ``schedule()``, as ``EngineCore`` does with an abort that arrives between steps."""
        if at_once:
            self._finish_aborted([request_id])
        else:
            self.pending_aborts.append(request_id)

    def fault(self) -> None:
        """A fault in the engine loop, as vLLM's fault tolerance handles it: the steps
        in flight never run, ``on_fault`` finishes every request, and the drain passes
        an empty output."""
        from vllm.v1.core.sched.output import SchedulerOutput
        from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
        from vllm.v1.request import RequestStatus

        self.in_flight.clear()
        self.pending_aborts.clear()
        self.scheduler.finish_requests(None, RequestStatus.FINISHED_ABORTED)
        self.call_update(SchedulerOutput.make_empty(), EMPTY_MODEL_RUNNER_OUTPUT)

    def _finish_aborted(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` in the scheduler; the steps in flight still compute them."""
        from vllm.v1.request import RequestStatus

        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def call_schedule(self) -> Any:
        """``scheduler.schedule()``, the only place this loop calls it."""
        return self.scheduler.schedule()

    def call_update(self, output: Any, result: Any) -> Any:
        """``scheduler.update_from_output()``, the only place this loop calls it."""
        return self.scheduler.update_from_output(output, result)

    def schedule(self) -> Any:
        """Run one ``schedule()`` and queue its step."""
        output = self.call_schedule()
        plan = self.worker.plan(output)
        if self.scheduler.num_spec_tokens and self.in_flight:
            # A request admitted (new or resumed) starts where the scheduler says.
            admitted = {req.req_id for req in output.scheduled_new_reqs}
            from vllm_prefix_guard.rules.failed_kv_loads import resumed_req_ids

            admitted.update(resumed_req_ids(output.scheduled_cached_reqs))
            drafted = [read for step in self.in_flight for read in step.reads if read.draft_ids]
            for read in plan.reads:
                if read.request_id not in admitted:
                    read.earlier = [e for e in drafted if e.request_id == read.request_id]
        self.in_flight.append(plan)
        self.outputs.append(output)
        self.scheduled_tokens += output.total_num_scheduled_tokens
        self.preemptions += len(output.preempted_req_ids or ())
        self.trajectory = hash(
            (self.trajectory, output.total_num_scheduled_tokens, len(output.num_scheduled_tokens))
        )
        stats = self.scheduler.kv_cache_manager.make_prefix_cache_stats()
        if stats is not None:
            self.hit_tokens += stats.hits
            self.query_tokens += stats.queries
            self.preempted_hit_tokens += stats.preempted_hits
            self.preempted_query_tokens += stats.preempted_queries
        return output

    def complete(self) -> Any:
        """Execute the oldest in-flight step and feed its result to ``update_from_output``."""
        plan = self.in_flight.popleft()
        result = self.worker.execute(plan)
        if self.pending_aborts:
            self._finish_aborted(self.pending_aborts)
            self.pending_aborts = []
        outputs = self.call_update(plan.output, result)
        if plan.excused and outputs:
            self._check_excused(plan, outputs)
        if self.drafts_after_update:
            self._propose_drafts(plan)
        return result

    @property
    def drafts_after_update(self) -> bool:
        """Whether this engine hands the scheduler the drafts of a step after its update
        (speculative decoding without async scheduling: ``EngineCore.post_step``; async
        scheduling schedules placeholders the worker fills)."""
        scheduler = self.scheduler
        return bool(scheduler.num_spec_tokens) and not getattr(
            scheduler.scheduler_config, "async_scheduling", False
        )

    def _propose_drafts(self, plan: StepPlan) -> None:
        """The fake drafter's tokens after each request of the step just updated (the
        scheduler ignores them for a prefill chunk, as it does a real drafter's)."""
        from vllm.v1.outputs import DraftTokenIds

        scheduler, k = self.scheduler, self.scheduler.num_spec_tokens
        req_ids, drafts = [], []
        for read in plan.reads:
            request = scheduler.requests.get(read.request_id)
            if request is None or request.is_finished():
                continue
            n = request.num_tokens
            req_ids.append(read.request_id)
            drafts.append([draft_token(read.model, read.request_id, p) for p in range(n, n + k)])
        if req_ids:
            scheduler.update_draft_token_ids(DraftTokenIds(req_ids, drafts))

    def _check_excused(self, plan: StepPlan, outputs: Any) -> None:
        """A read a pending report excused is a known loss only if vLLM recomputes it:
        the token its step sampled must not reach the client."""
        step = self.worker.steps_executed - 1
        for client_outputs in outputs.values():
            for output in client_outputs.outputs:
                if output.request_id in plan.excused and output.new_token_ids:
                    self.kv.record(Violation(step, output.request_id, -1, -1, OUTPUT_OVER_BAD_KV))

    def step(self) -> None:
        """One engine iteration, as ``step_with_batch_queue``: schedule a step if there is
        room in the pipeline, then complete the oldest once the pipeline is full (or
        nothing is left to schedule). With ``depth=1`` this is ``EngineCore.step``."""
        if len(self.in_flight) < self.depth and self.scheduler.has_requests():
            self.schedule()
        if self.in_flight and (
            len(self.in_flight) >= self.depth or not self.scheduler.has_requests()
        ):
            self.complete()

    def run(self, max_steps: int = 10_000) -> int:
        """Step until no request is left and nothing is in flight; return steps taken."""
        for n in range(max_steps):
            if not self.scheduler.has_requests() and not self.in_flight:
                return n
            self.step()
        raise RuntimeError(f"scheduler still busy after {max_steps} steps")

    @property
    def violations(self) -> int:
        return sum(self.kv.counts.values())
