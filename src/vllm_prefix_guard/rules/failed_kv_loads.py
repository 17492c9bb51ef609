# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries and computed tokens that a failed KV load leaves wrong.

A KV connector loads a request's external prefix into blocks that
`allocate_slots` registered in the prefix cache before the load ran. When the
worker reports the load of some blocks as failed (`invalid_block_ids`), vLLM
truncates the first running request holding each invalid block so that it
recomputes from there (policy `recompute`) or fails it (policy `fail`). That
leaves three ways to read bad KV, which `FailedKVLoads` closes:

- the loader's entries from its first invalid block on stay cached, and under
  `fail` (or when the loader is aborted or preempted first) nobody rewrites
  them: a later request hits KV that failed to load;
- every other holder of an invalid block keeps it as computed, trusting the
  first to rewrite it before they read it, which nothing guarantees (its
  recompute is chunked, it can be aborted, a newcomer can hit it meanwhile);
- steps already in flight computed over the bad KV: the loader's next chunks,
  and requests admitted on a prefix hit that includes a bad block. Their
  entries name KV computed over bad KV.
"""

from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING

from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_prefix_guard.rules.block_pool import StepCacheEntries, UncommittedEntry

if TYPE_CHECKING:
    from vllm_prefix_guard.rules.uncommitted import UncommittedPrefixCache


def partition(
    entries: list[UncommittedEntry], keep: Callable[[UncommittedEntry], bool]
) -> tuple[list[UncommittedEntry], list[UncommittedEntry]]:
    """(The entries `keep` holds for, the others), each in order."""
    kept: list[UncommittedEntry] = []
    other: list[UncommittedEntry] = []
    for entry in entries:
        (kept if keep(entry) else other).append(entry)
    return kept, other


def blocks_read(
    block_ids: Sequence[Sequence[int]],
    num_computed_tokens: int,
    block_sizes: Sequence[int],
) -> Iterator[int]:
    """The blocks, in every KV cache group, holding the first
    `num_computed_tokens` tokens of a request."""
    for group_block_ids, block_size in zip(block_ids, block_sizes, strict=True):
        yield from group_block_ids[: -(-num_computed_tokens // block_size)]


def admissions(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, Sequence[Sequence[int]], int]]:
    """The requests a step admits (new or resumed): ID, block IDs per KV cache
    group, and tokens computed when admitted (prefix-cache hit plus tokens
    loaded by a KV connector, whose blocks come first)."""
    for new_req in scheduler_output.scheduled_new_reqs:
        if new_req.block_ids:
            yield new_req.req_id, new_req.block_ids, new_req.num_computed_tokens
    cached = scheduler_output.scheduled_cached_reqs
    resumed = resumed_req_ids(cached)
    if resumed:
        for index, req_id in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[index]
            if req_id in resumed and block_ids:
                yield req_id, block_ids, cached.num_computed_tokens[index]


def resumed_req_ids(cached_reqs: CachedRequestData) -> Collection[str]:
    """The cached requests a step resumes after a preemption, with their whole
    block list. vLLM 0.30-0.33 name them (`resumed_req_ids`); 0.34 has no such
    field: it sends a resumed request again among the new ones."""
    return getattr(cached_reqs, "resumed_req_ids", None) or ()


def first_computed_tokens(scheduler_output: SchedulerOutput) -> dict[str, int]:
    """Request ID -> the first token the step computes, for every request."""
    starts = {
        new_req.req_id: new_req.num_computed_tokens
        for new_req in scheduler_output.scheduled_new_reqs
    }
    cached = scheduler_output.scheduled_cached_reqs
    starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    return starts


class FailedKVLoads:
    """The rollback of one step's failed KV loads.

    A block is *bad* when its load failed or an entry on it is removed here.
    `roll_back` visits the failing step and every later step in flight, oldest
    first, and removes:

    - each loader's entries from its first invalid token on, in every KV cache
      group (a hybrid model computes every group's KV of a token from all
      groups' KV of the tokens before it), and all its entries in later steps
      until it is admitted afresh;
    - the entries of every request admitted on a prefix hit that includes a bad
      block it neither writes in that step nor still holds unchanged (a block
      the step copies from one bad when the step began, a Mamba partial hit's
      copy-on-write, is read as its source, and an entry moved onto it is
      removed), from its hit on; found to a fixed point, since a same-step hit
      on a block such a reader registered is bad too. What a reader loaded or
      wrote below its hit stays, unless a later step in flight computes it
      again from a lower token (vLLM blamed it, by block ID, for an earlier
      failed load on a block it was given since, and rewound it): then that
      goes too.

    A block whose removed entry was already stale (the block was evicted and
    reused since) holds other content than the entry named: once a step walked
    after that entry's rewrites it cleanly (a copy from a block that was not
    bad, or an entry that stays), a hit on it or a copy from it reads that
    content, not bad KV.

    Invariant: when `roll_back` returns, no entry of those steps names KV that was
    loaded by the failed load or computed over it, and `reads_bad_kv` holds
    for every running request that still counts such KV as computed. Loaders
    that stay have their cached-block counts rewound, so they cache the blocks
    again once recomputed.

    Cost: O(entries removed + blocks the admissions of the steps walked hit).
    """

    def __init__(
        self, uncommitted: "UncommittedPrefixCache", running_req_ids: set[str]
    ) -> None:
        self.uncommitted = uncommitted
        self.kv_cache_manager = uncommitted.kv_cache_manager
        self.block_sizes = [
            manager.block_size
            for manager in self.kv_cache_manager.coordinator.single_type_managers
        ]
        self.running_req_ids = running_req_ids
        # Loader request ID -> IDs of the blocks whose entries were removed.
        self.loaders: dict[str, set[int]] = {}
        # Other requests that computed over bad KV and still count it as
        # computed in their latest admission.
        self.readers: set[str] = set()
        # Bad block ID -> whether an entry removed from it was still cached
        # (False: the block was evicted and reused since, so a hit on it may be
        # on its new, valid content).
        self.bad_blocks: dict[int, bool] = {}
        # Bad block ID -> the latest step walked (index) that registered a bad
        # entry on it, and block ID -> the latest that rewrote it cleanly (a
        # copy from a block that was not bad, or an entry that stays): a block
        # whose bad entry was stale is read as its new content once a later
        # step rewrote it.
        self.bad_since: dict[int, int] = {}
        self.rewritten: dict[int, int] = {}
        # The step being walked, and the steps (their entries' origin).
        self.index = 0
        self.steps: list[tuple[SchedulerOutput, StepCacheEntries]] = []

    def roll_back(
        self,
        scheduler_output: SchedulerOutput,
        invalid_block_ids: set[int],
        loader_req_ids: Collection[str] | None = None,
    ) -> None:
        """Roll back the failed loads of the step of `scheduler_output`, through
        every later step in flight (nothing if that step is not in flight).

        Args:
            scheduler_output: The step that reported the failure.
            invalid_block_ids: The blocks whose load failed.
            loader_req_ids: The requests whose loads failed, if known (None: every
                request with an entry of that step on an invalid block, as a
                connector names blocks only).

        """
        steps = self.uncommitted.steps_in_flight()
        for index, (output, _) in enumerate(steps):
            if output is scheduler_output:
                self.walk(steps[index:], invalid_block_ids, loader_req_ids)
                return

    def walk(
        self,
        steps: list[tuple[SchedulerOutput, StepCacheEntries]],
        invalid_block_ids: set[int],
        loader_req_ids: Collection[str] | None = None,
    ) -> None:
        """Roll back the failed loads of `steps[0]`, through every later step
        in `steps` (oldest first)."""
        self.steps = steps
        self.bad_blocks.update(dict.fromkeys(invalid_block_ids, False))
        loaders = self._remove_loaders(*steps[0], invalid_block_ids, loader_req_ids)
        # Requests whose computation in the step being walked reads bad KV.
        tainted = set(loaders)
        # Reader -> the record of its admission, which keeps the entries it had
        # loaded or written before it read bad KV.
        kept: dict[str, StepCacheEntries] = {}
        # Loaders admitted afresh in a later step (preempted, say by a reset, and
        # resumed at once on their own load's entries): a reader there, whose output
        # of that step vLLM's truncation of the loader leaves deliverable.
        readmitted: set[str] = set()
        for index, (output, entries) in enumerate(steps):
            self.index = index
            # The step's block copies ran before its forward pass: from what was bad
            # when it began, which the steps walked before it made bad (none for the
            # first: its own entries name what it writes after its copies).
            copied_from = self._copied_from_bad(output) if index else {}
            admitted: dict[str, tuple[Sequence[Sequence[int]], int]] = {}
            for req_id, block_ids, num_computed_tokens in admissions(output):
                if index or req_id not in loaders:
                    if req_id in loaders:
                        readmitted.add(req_id)
                    admitted[req_id] = (block_ids, num_computed_tokens)
                    tainted.discard(req_id)  # Admitted afresh: judged below.
                    kept.pop(req_id, None)
            if index:
                if kept:
                    starts = first_computed_tokens(output)
                    for req_id, admission_entries in kept.items():
                        if req_id in starts:
                            self._remove_computed_from(
                                admission_entries, req_id, starts[req_id]
                            )
                # Tainted since an earlier step: all of it is over bad KV.
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

    def reads_bad_kv(self, request: Request) -> bool:
        """Whether a running request still counts bad KV as computed (and must
        recompute: vLLM truncates only the first holder of an invalid block)."""
        req_id = request.request_id
        if req_id in self.readers:
            return True
        return req_id in self.loaders and any(
            block_id in self.bad_blocks
            for block_id in blocks_read(
                self.kv_cache_manager.get_block_ids(req_id),
                request.num_computed_tokens,
                self.block_sizes,
            )
        )

    def drop_stale_output(self, requests: Mapping[str, Request]) -> int:
        """Drop the output still in flight of the requests that computed over
        bad KV and that vLLM preempted since (a priority preemption inside a
        later `schedule()`, before this report). Returns how many.

        Such a request is no longer running, so nothing preempts it here, but
        vLLM delivers a preempted request's in-flight output by default (its
        stale share), and all of it is computed over bad KV: it was admitted
        in one of the steps walked, and it cannot have resumed since, as vLLM
        resumes no request with deliverable output still in flight. Set to
        drop, that output is discarded and the request resumes at once.

        Call it before the output of the reporting step is read: a reader
        admitted in that step has its token there.
        """
        dropped = 0
        for req_id in self.readers | self.loaders.keys():
            request = requests.get(req_id)
            if (
                request is not None
                and request.status == RequestStatus.PREEMPTED
                and request.num_stale_output_tokens
                and not request.drop_stale_output
            ):
                request.drop_stale_output = True
                dropped += 1
        return dropped

    def _remove_loaders(
        self,
        scheduler_output: SchedulerOutput,
        entries: StepCacheEntries,
        invalid_block_ids: set[int],
        loader_req_ids: Collection[str] | None,
    ) -> set[str]:
        """Remove each loader's entries past its first failed token, but for the
        blocks that loaded fine: their KV is what the connector loaded, which
        does not depend on the failed block before it.

        Without `loader_req_ids`, a loader is a request with an entry on an
        invalid block. With it, only those requests are: their entries of
        later steps moved here (`gather_not_computed`) can be on blocks that
        another request of this step registered and wrote, then freed when
        preempted in a later step, which handed them on.
        """
        loaded_tokens = {
            req_id: num_computed_tokens
            for req_id, _, num_computed_tokens in admissions(scheduler_output)
        }
        loaders = set()
        for req_id, req_entries in list(entries.items()):
            if req_id is None or (
                loader_req_ids is not None and req_id not in loader_req_ids
            ):
                continue
            failed = [e for e in req_entries if e[1].block_id in invalid_block_ids]
            if not failed:
                continue
            failed_from = min(self._block_start(e) for e in failed)
            del entries[req_id]
            written, unwritten = self.uncommitted.split_written(
                req_entries, failed_from
            )
            loaded_fine, unwritten = self.uncommitted.split_written(
                unwritten, loaded_tokens.get(req_id, 0)
            )
            loaded_fine, failed = partition(
                loaded_fine, lambda e: e[1].block_id not in invalid_block_ids
            )
            self.uncommitted.keep(entries, req_id, written + loaded_fine)
            self.loaders[req_id] = self._remove_bad(req_id, failed + unwritten)
            loaders.add(req_id)
        return loaders

    def _copied_from_bad(self, scheduler_output: SchedulerOutput) -> dict[int, int]:
        """The blocks a step copies from a bad block, destination -> source.

        A Mamba partial prefix-cache hit reads its state through a private copy
        of the block it hit (`kv_cache_block_copies`), and a running request's
        checkpoint moves onto such a copy when its step would overwrite the
        block (`move_block_hashes`). A copy holds what its source held.
        """
        return {
            copy.dst_block_id: copy.src_block_id
            for copy in scheduler_output.kv_cache_block_copies or ()
            if self._is_bad(copy.src_block_id)
        }

    def _remove_moved_onto(
        self, entries: StepCacheEntries, copied_from: dict[int, int]
    ) -> None:
        """Remove the entries a step moved onto a copy of a bad block (made on
        no request's behalf, kept under None)."""
        if copied_from and None in entries:
            moved, other = partition(
                entries.pop(None), lambda e: e[1].block_id in copied_from
            )
            self.uncommitted.keep(entries, None, other)
            self._remove_bad(None, moved)

    def _remove_readers(
        self,
        entries: StepCacheEntries,
        admitted: dict[str, tuple[Sequence[Sequence[int]], int]],
        tainted: set[str],
        kept: dict[str, StepCacheEntries],
        copied_from: dict[int, int],
    ) -> None:
        """Remove what the admissions of one step compute over a bad block,
        until no more are found (a same-step hit on a block a reader
        registered is bad too). A block the step copied from a bad one
        (`copied_from`) is read as its source."""
        changed = True
        while changed:
            changed = False
            for req_id, (block_ids, num_computed_tokens) in list(admitted.items()):
                own = {block.block_id for _, block, _ in entries.get(req_id, ())}
                read = blocks_read(block_ids, num_computed_tokens, self.block_sizes)
                if not any(
                    self._reads_bad(req_id, copied_from.get(block_id, block_id), own)
                    for block_id in read
                ):
                    continue
                del admitted[req_id]
                tainted.add(req_id)
                # What it loaded or wrote before this step does not depend on
                # what it reads here; what it computes here does.
                self._remove_computed_from(entries, req_id, num_computed_tokens)
                kept[req_id] = entries
                changed = True

    def _reads_bad(self, req_id: str, block_id: int, own: set[int]) -> bool:
        """Whether a request admitted on a hit that includes a block reads bad
        KV there: the block is bad, the request does not write it in the step,
        and it does not still hold it unchanged (an entry removed from the
        block after it was evicted may name other content than the hit)."""
        return (
            self._is_bad(block_id)
            and block_id not in own
            and (self.bad_blocks[block_id] or not self._holds(req_id, block_id))
        )

    def _remove_computed_from(
        self, entries: StepCacheEntries, req_id: str, num_tokens: int
    ) -> None:
        """Remove a reader's entries that reach past token `num_tokens`."""
        written, unwritten = self.uncommitted.split_written(
            entries.pop(req_id, []), num_tokens
        )
        self.uncommitted.keep(entries, req_id, written)
        self._remove_bad(req_id, unwritten)

    def _remove_bad(
        self, req_id: str | None, entries: list[UncommittedEntry]
    ) -> set[int]:
        """Remove entries loaded as, or computed over, bad KV; their blocks
        become bad. Returns their block IDs."""
        # A loader's entries in the first step walked may have been moved there
        # from any later step it is scheduled in (`gather_not_computed`).
        since = self.index
        if not since and req_id is not None:
            since = max(
                i
                for i, (output, _) in enumerate(self.steps)
                if not i or req_id in output.num_scheduled_tokens
            )
        for entry in reversed(entries):
            block_id = entry[1].block_id
            removed = self.uncommitted.remove_entry(req_id, entry)
            self.bad_blocks[block_id] = removed or self.bad_blocks.get(block_id, False)
            self.bad_since[block_id] = max(since, self.bad_since.get(block_id, 0))
        return {block.block_id for _, block, _ in entries}

    def _is_bad(self, block_id: int) -> bool:
        """Whether a block is bad when the step being walked begins: an entry
        on it was removed (or its load failed), and unless that entry was still
        cached, no step walked since rewrote it cleanly."""
        if block_id not in self.bad_blocks:
            return False
        return self.bad_blocks[block_id] or self.rewritten.get(
            block_id, -1
        ) <= self.bad_since.get(block_id, 0)

    def _note_rewritten(
        self,
        scheduler_output: SchedulerOutput,
        entries: StepCacheEntries,
        copied_from: dict[int, int],
    ) -> None:
        """Note the blocks the step being walked rewrote cleanly: the copies
        from blocks that were not bad, and the blocks of its entries that
        stay."""
        for copy in scheduler_output.kv_cache_block_copies or ():
            if copy.dst_block_id not in copied_from:
                self.rewritten[copy.dst_block_id] = self.index
        for req_entries in entries.values():
            for _, block, _ in req_entries:
                self.rewritten[block.block_id] = self.index

    def _holds(self, req_id: str, block_id: int) -> bool:
        """Whether a running request holds a block (taken before the failure
        is handled, after any reuse of the block)."""
        return req_id in self.running_req_ids and any(
            block_id in group_block_ids
            for group_block_ids in self.kv_cache_manager.get_block_ids(req_id)
        )

    def _block_start(self, entry: UncommittedEntry) -> int:
        """The first token of the block an entry registered."""
        block_hash, _, num_hash_tokens = entry
        if not num_hash_tokens:
            return 0
        block_size = self.block_sizes[get_group_id(block_hash)]
        return (num_hash_tokens - 1) // block_size * block_size
