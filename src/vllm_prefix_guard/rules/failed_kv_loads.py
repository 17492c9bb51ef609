# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""Prefix-cache entries and computed tokens that a failed KV load leaves wrong.

A KV connector loads into blocks that `allocate_slots` registered before the
load ran. For each block the worker reports invalid, vLLM makes the first
running holder recompute (policy `recompute`) or fails it (`fail`). That
leaves the loader's entries past its first invalid block cached, every other
holder counting the block as computed, and steps in flight computing over it.

`FailedKVLoads.roll_back` walks the failing step and the later steps in
flight, oldest first, and removes:

- each loader's entries from its first invalid token on, in every KV cache
  group, but for blocks that loaded fine; and all its entries in later steps
  until it is admitted afresh;
- the entries of each request admitted on a hit of a bad block it does not
  write in that step, from its hit on; to a fixed point, as a same-step hit on
  such a reader's block is bad too.

A block is bad once its load failed or an entry on it was removed.
NOTE: no block of a step in flight is reused before the report: vLLM defers
such frees wherever a load can fail (`defer_block_free`).

Cost: O(entries removed + blocks the walked admissions hit).
"""

from collections.abc import Collection, Iterator, Mapping, Sequence

from vllm.v1.core.kv_cache_utils import get_group_id
from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
from vllm.v1.request import Request, RequestStatus

from vllm_prefix_guard.rules.block_pool import StepCacheEntries, UncommittedEntry
from vllm_prefix_guard.rules.uncommitted import (
    UncommittedPrefixCache,
    keep_entries,
    split_written,
)

# Block IDs per KV cache group, and the tokens computed when admitted.
Admission = tuple[Sequence[Sequence[int]], int]


def blocks_read(
    block_ids: Sequence[Sequence[int]],
    num_computed_tokens: int,
    block_sizes: Sequence[int],
) -> Iterator[int]:
    """The blocks, in every KV cache group, holding a request's first
    `num_computed_tokens` tokens."""
    for group_block_ids, block_size in zip(block_ids, block_sizes, strict=True):
        yield from group_block_ids[: -(-num_computed_tokens // block_size)]


def admissions(
    scheduler_output: SchedulerOutput,
) -> Iterator[tuple[str, Sequence[Sequence[int]], int]]:
    """The requests a step admits, new or resumed: ID and `Admission` fields
    (computed: prefix-cache hit plus KV loaded by a connector)."""
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


def block_start(entry: UncommittedEntry, block_sizes: Sequence[int]) -> int:
    """The first token of the block an entry registered."""
    block_hash, _, num_hash_tokens = entry
    if not num_hash_tokens:
        return 0
    block_size = block_sizes[get_group_id(block_hash)]
    return (num_hash_tokens - 1) // block_size * block_size


def resumed_req_ids(cached_reqs: CachedRequestData) -> Collection[str]:
    """The cached requests a step resumes (vLLM 0.34 sends them as new)."""
    return getattr(cached_reqs, "resumed_req_ids", None) or ()


class FailedKVLoads:
    """The rollback of one step's failed KV loads. Afterwards `reads_bad_kv`
    holds for every running request that counts bad KV as computed, and the
    loaders have their cached-block counts rewound. Subclasses extend the
    removal steps: `remove_loaders`, `remove_computed_from`, `remove_bad`."""

    def __init__(self, uncommitted: UncommittedPrefixCache) -> None:
        self.uncommitted = uncommitted
        self.kv_cache_manager = uncommitted.kv_cache_manager
        self.block_sizes = [
            manager.block_size
            for manager in self.kv_cache_manager.coordinator.single_type_managers
        ]
        self.bad_block_ids: set[int] = set()
        # Loader request ID -> IDs of its blocks whose entries were removed.
        self.loaders: dict[str, set[int]] = {}
        self.readers: set[str] = set()  # Others that still count bad KV.

    def roll_back(
        self, scheduler_output: SchedulerOutput, invalid_block_ids: set[int]
    ) -> None:
        """Roll back the failed loads of `invalid_block_ids` reported with the
        output of `scheduler_output` (nothing if that step is not in flight)."""
        steps = self.uncommitted.steps_in_flight()
        first = [i for i, (output, _) in enumerate(steps) if output is scheduler_output]
        if not first:
            return
        assert not self.loaders, "one rollback per FailedKVLoads"
        steps = steps[first[0] :]
        self.bad_block_ids = set(invalid_block_ids)
        loaders = self.remove_loaders(*steps[0], invalid_block_ids)
        tainted = set(loaders)  # Requests computing over bad KV in the step.
        readmitted: set[str] = set()  # Loaders admitted afresh: readers there.
        for index, (output, entries) in enumerate(steps):
            admitted: dict[str, Admission] = {}
            for req_id, block_ids, num_computed_tokens in admissions(output):
                if index or req_id not in loaders:
                    if req_id in loaders:
                        readmitted.add(req_id)
                    admitted[req_id] = (block_ids, num_computed_tokens)
                    tainted.discard(req_id)
            if index:
                for req_id in [r for r in entries if r in tainted]:
                    removed = self.remove_bad(req_id, entries.pop(req_id))
                    if req_id in self.loaders:
                        self.loaders[req_id].update(removed)
            self._remove_readers(entries, admitted, tainted)
        self.readers = tainted - (loaders - readmitted)
        self.kv_cache_manager.rewind_num_cached_blocks(self.loaders)

    def reads_bad_kv(self, request: Request) -> bool:
        """Whether a running request still counts bad KV as computed."""
        req_id = request.request_id
        if req_id in self.readers:
            return True
        return req_id in self.loaders and any(
            block_id in self.bad_block_ids
            for block_id in blocks_read(
                self.kv_cache_manager.get_block_ids(req_id),
                request.num_computed_tokens,
                self.block_sizes,
            )
        )

    def drop_stale_output(self, requests: Mapping[str, Request]) -> int:
        """Drop the in-flight output, computed over bad KV, of readers and
        loaders vLLM preempted since (priority, in a later `schedule()`), which
        it would deliver; returns how many. Call before the output is read."""
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

    def remove_loaders(
        self,
        scheduler_output: SchedulerOutput,
        entries: StepCacheEntries,
        invalid_block_ids: set[int],
    ) -> set[str]:
        """Remove each loader's (request with an entry on an invalid block)
        entries past its first failed token, but for blocks that loaded fine:
        their KV does not depend on the failed block."""
        loaded_tokens = {
            req_id: num_computed_tokens
            for req_id, _, num_computed_tokens in admissions(scheduler_output)
        }
        for req_id, req_entries in list(entries.items()):
            if req_id is None:
                continue
            failed = [e for e in req_entries if e[1].block_id in invalid_block_ids]
            if not failed:
                continue
            failed_from = min(block_start(e, self.block_sizes) for e in failed)
            written, unwritten = split_written(entries.pop(req_id), failed_from)
            loaded, unwritten = split_written(unwritten, loaded_tokens.get(req_id, 0))
            loaded_fine = [e for e in loaded if e[1].block_id not in invalid_block_ids]
            failed = [e for e in loaded if e[1].block_id in invalid_block_ids]
            keep_entries(entries, req_id, written + loaded_fine)
            self.loaders[req_id] = self.remove_bad(req_id, failed + unwritten)
        return set(self.loaders)

    def _remove_readers(
        self,
        entries: StepCacheEntries,
        admitted: dict[str, Admission],
        tainted: set[str],
    ) -> None:
        """Remove what a step's admissions compute over a bad block, to a fixed
        point; add those requests to `tainted`."""
        changed = True
        while changed:
            changed = False
            for req_id, (block_ids, num_computed_tokens) in list(admitted.items()):
                own = {block.block_id for _, block, _ in entries.get(req_id, ())}
                if not any(
                    block_id in self.bad_block_ids and block_id not in own
                    for block_id in blocks_read(
                        block_ids, num_computed_tokens, self.block_sizes
                    )
                ):
                    continue
                del admitted[req_id]
                tainted.add(req_id)
                self.remove_computed_from(entries, req_id, num_computed_tokens)
                changed = True

    def remove_computed_from(
        self, entries: StepCacheEntries, req_id: str, num_tokens: int
    ) -> None:
        """Remove a reader's entries past token `num_tokens` (its hit)."""
        written, unwritten = split_written(entries.pop(req_id, []), num_tokens)
        keep_entries(entries, req_id, written)
        self.remove_bad(req_id, unwritten)

    def remove_bad(
        self, req_id: str | None, entries: list[UncommittedEntry]
    ) -> set[int]:
        """Remove entries of bad KV; their blocks become bad. Returns them."""
        self.uncommitted.remove_entries(req_id, entries)
        block_ids = {block.block_id for _, block, _ in entries}
        self.bad_block_ids |= block_ids
        return block_ids
