"""The patch table: every change the guard makes to vLLM, why, and when it can go.

One :class:`~vllm_prefix_guard.patching.Patch` per target, as vllm-ascend keeps a
Why / How / PR / Future plan for each of its patches. Everything else reads this table:
the start-up checks (:func:`vllm_prefix_guard.targets.patch_internals`: each target, with
the parameters its replacement names), the plugin's install and its one log line per
patch, ``doctor``, and docs/design.md's registry (``tests/unit/test_patches.py`` fails if that
page or a patch's reasons fall behind).

"Upstream" names the pull requests against vLLM 0.34.0 in ``upstream/out/prs/`` (each alone
upstreamable) and the parts of the series against 0.33.0 (``upstream/out/series/``). The
guard steps aside by itself for a vLLM that has the series (``targets.native_fix``).

Imports nothing of vLLM: ``compat/static_check.py`` reads the targets from a release's
source before it is installed.
"""

from __future__ import annotations

from vllm_prefix_guard.patching import Patch

SCHEDULER = "vllm.v1.core.sched.scheduler"
MANAGER = "vllm.v1.core.kv_cache_manager"
BLOCK_POOL = "vllm.v1.core.block_pool"

_HOOKS = "vllm_prefix_guard.hooks"
_POOL = "vllm_prefix_guard.pool"

_PART_1 = "series part 1 (0001-commit-prefix-cache-entries-once-written)"
_PART_2 = "series part 2 (0002-roll-back-failed-kv-loads)"
_PART_3 = "series part 3 (0003-emit-block-removed-for-the-last-copy)"
_GONE_WITH_PART_1 = "vLLM carries series part 1, or the four pull requests in upstream/out/prs/"

PATCHES: tuple[Patch, ...] = (
    Patch(
        SCHEDULER,
        "Scheduler.__init__",
        f"{_HOOKS}:wrap_init",
        why="each scheduler with prefix caching needs its own record of the entries its "
        "steps registered before their KV is written, over its pool",
        upstream=f"{_PART_1}: Scheduler.uncommitted_prefix_cache",
        remove_when=_GONE_WITH_PART_1,
    ),
    Patch(
        SCHEDULER,
        "Scheduler.schedule",
        f"{_HOOKS}:wrap_schedule",
        why="allocate_slots registers block hashes for tokens the step is about to compute: "
        "a step's entries are recorded from the start of schedule() until its output",
        upstream=f"{_PART_1}; PR evict-preempted-blocks",
        remove_when=_GONE_WITH_PART_1,
    ),
    Patch(
        SCHEDULER,
        "Scheduler._preempt_request",
        f"{_HOOKS}:wrap_preempt_request",
        why="a priority victim may have registered entries in this very schedule(): they "
        "are removed before its blocks are freed, or a later request hits unwritten KV",
        upstream=f"{_PART_1}; PR evict-preempted-blocks",
        remove_when="vLLM merges evict-preempted-blocks, or carries series part 1",
        params=("request",),
    ),
    Patch(
        SCHEDULER,
        "Scheduler.update_from_output",
        f"{_HOOKS}:wrap_update_from_output",
        why="a failed KV load leaves its blocks, and KV computed over them, in the prefix "
        "cache; a step's entries are valid only once its output came back",
        upstream=f"{_PART_1}, {_PART_2}; PR evict-invalid-blocks",
        remove_when="vLLM merges evict-invalid-blocks, or carries series parts 1 and 2",
        params=("scheduler_output", "model_runner_output"),
    ),
    Patch(
        SCHEDULER,
        "Scheduler.reset_prefix_cache",
        f"{_HOOKS}:wrap_reset_prefix_cache",
        why="once the pool dropped every hash, the records of the steps in flight name "
        "entries that are gone",
        upstream=_PART_1,
        remove_when=_GONE_WITH_PART_1,
    ),
    Patch(
        SCHEDULER,
        "Scheduler.finish_requests",
        f"{_HOOKS}:wrap_finish_requests",
        why="fault tolerance finishes every request after a fault (request_ids None): the "
        "steps in flight never write their KV",
        upstream=f"{_PART_1}; PR evict-faulted-steps",
        remove_when="vLLM merges evict-faulted-steps, or carries series part 1",
        params=("request_ids",),
    ),
    Patch(
        SCHEDULER,
        "Scheduler.shutdown",
        f"{_HOOKS}:wrap_shutdown",
        why="operators read the counters' last values: the stats file's last write and one "
        "INFO line, before vLLM's own shutdown (which runs whatever reporting does)",
        upstream="none: reporting of the plugin's own counters",
        remove_when="the guard goes",
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool.cache_full_blocks",
        f"{_POOL}:wrap_cache_full_blocks",
        why="every full block it gives a hash is a new (key, block) entry of the request's "
        "step, recorded so that the exact pair can be removed (another block may cache the "
        "same key: kvcached #401/#402); blocks a failed load's rollback kept are cached "
        "around; with KV events, BlockStored only for a hash's first block",
        upstream=f"{_PART_1}, {_PART_2}, {_PART_3}; PR kv-events-per-hash",
        remove_when="vLLM carries the series (PR kv-events-per-hash for the events)",
        params=(
            "request",
            "blocks",
            "num_cached_blocks",
            "num_full_blocks",
            "block_size",
            "kv_cache_group_id",
            "block_mask",
        ),
        exact=True,
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool.cache_partial_block",
        f"{_POOL}:wrap_cache_partial_block",
        why="hybrid models' state blocks (align mode) are registered here: its new entry "
        "is recorded like a full block's",
        upstream=f"{_PART_1}, {_PART_3}; PR kv-events-per-hash",
        remove_when="vLLM carries the series",
        params=(
            "request",
            "block",
            "num_tokens",
            "kv_cache_group_id",
            "block_size",
            "replace_existing_hashes",
        ),
        exact=True,
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool.move_block_hashes",
        f"{_POOL}:wrap_move_block_hashes",
        why="a copy-on-write move of a Mamba checkpoint re-registers its entries on a block "
        "the step being scheduled writes: they are that step's entries",
        upstream=_PART_1,
        remove_when=_GONE_WITH_PART_1,
        params=("src_block", "dst_block"),
        exact=True,
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool._emit_block_removed_events",
        f"{_POOL}:wrap_emit_block_removed_events",
        why="BlockRemoved while another block still caches the hash makes a set-keeping "
        "router drop a hash the cache still serves",
        upstream=f"{_PART_3}; PR kv-events-per-hash",
        remove_when="vLLM merges kv-events-per-hash, or carries series part 3",
        params=("block_hashes",),
        exact=True,
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool",
        "vllm_prefix_guard.rules.block_pool:BlockPoolAdditions",
        why="what the series adds to BlockPool, installed as written there: exact removal "
        "of one (key, block) pair, the hashes no block caches any more, first-copy events, "
        "caching around kept blocks",
        upstream=f"{_PART_1}, {_PART_2}, {_PART_3}",
        remove_when="vLLM carries the series",
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool",
        f"{_POOL}:PoolState",
        why="a pool passes every call through until a scheduler's guard attaches to it: "
        "these class-level defaults say no step is open",
        upstream=f"{_PART_1}, {_PART_2}: BlockPool.__init__ sets uncommitted_entries and "
        "kept_block_owners",
        remove_when="vLLM carries the series",
    ),
    Patch(
        BLOCK_POOL,
        "BlockPool.remove_uncommitted_entry",
        f"{_POOL}:wrap_remove_uncommitted_entry",
        why="counts what the rules removed; a pool whose evict_blocks frees more than hashes "
        "(kvcached returns the block's pages) evicts an unreferenced block through it",
        upstream="none: the plugin's counters and kvcached's pool",
        remove_when="vLLM carries the series",
        wraps_addition=True,
    ),
    Patch(
        MANAGER,
        "KVCacheManager",
        "vllm_prefix_guard.rules.kv_cache_manager:CachedBlockRewind",
        why="a loader that stays after a failed load must cache its blocks again once "
        "recomputed: its cached-block count is rewound",
        upstream=f"{_PART_2}; PR evict-invalid-blocks (KVCacheManager.recache_blocks_from)",
        remove_when="vLLM merges evict-invalid-blocks, or carries series part 2",
    ),
)
