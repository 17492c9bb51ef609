# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the upstream series adds to vLLM's `BlockPool`, verbatim.

`upstream/series.py` copies the two type aliases into `vllm/v1/core/block_pool.py`
(before `BlockHashToBlockMap`) and the methods of `BlockPoolAdditions` into
`BlockPool`; the plugin's pool mixin inherits them. Nothing here may differ
between the two.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.request import Request

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockHashToBlockMap

# A prefix-cache entry registered before the KV it names is written: the hash,
# the block, and the prefix length the hash names (the block holds valid KV for
# these tokens once the step that computes them has run).
UncommittedEntry = tuple[BlockHashWithGroupId, KVCacheBlock, int | None]

# The entries one scheduler step registered, per request. `allocate_slots`
# registers the blocks a step is about to compute, so that requests in the same
# batch can share them; until that step's output comes back, such an entry names
# KV that may never be written (the request can be preempted in the same
# `schedule()` call, or its KV load can fail). Entries made on no request's
# behalf (a copy-on-write move) are kept under None.
StepCacheEntries = dict[str | None, list[UncommittedEntry]]


class BlockPoolAdditions:
    """The methods the series adds to `BlockPool`."""

    if TYPE_CHECKING:
        cached_block_hash_to_block: BlockHashToBlockMap
        cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]]

        def _remove_cached_block_hashes(
            self, block: KVCacheBlock
        ) -> list[BlockHashWithGroupId]: ...

        def _emit_block_removed_events(
            self, block_hashes: list[BlockHashWithGroupId]
        ) -> None: ...

        def cache_full_blocks(
            self,
            request: Request,
            blocks: list[KVCacheBlock],
            num_cached_blocks: int,
            num_full_blocks: int,
            block_size: int,
            kv_cache_group_id: int,
            block_mask: list[bool] | None = None,
        ) -> None: ...

    def uncached_block_hashes(
        self, block_hashes: list[BlockHashWithGroupId]
    ) -> list[BlockHashWithGroupId]:
        """The hashes among `block_hashes` that no block caches any more.

        Several blocks can be cached under one hash: requests that compute the
        same prefix concurrently each fill a block of their own. KV events
        describe the hash, not its copies: `BlockRemoved` is due only when the
        last of those blocks loses it (until then a request still hits the
        others), as `BlockStored` is only when the first caches it
        (`first_copy_events`). A consumer that keeps a set of hashes and one
        that counts them then agree with the cache alike.

        Args:
            block_hashes: Hashes just removed from the prefix cache, each from
                one block.

        Returns:
            Those that no other block is cached under.

        """
        return [
            block_hash
            for block_hash in block_hashes
            if self.cached_block_hash_to_block.get_one_block(block_hash) is None
        ]

    @staticmethod
    def first_copy_events(
        stored: BlockStored, copies: Sequence[tuple[int, bool]]
    ) -> list[BlockStored]:
        """`stored` less the blocks whose hash another block cached already.

        A `BlockStored` announces hashes that just became cached. A block
        registered under a hash another block already caches (two requests
        that computed the same prefix) changes nothing a consumer can see, so
        it is left out, and the rest go as one event per run of consecutive
        blocks, each naming the block before it as its parent.

        Args:
            stored: The event of one `cache_full_blocks` call.
            copies: For each block it lists, in order: its position among
                the blocks the call cached (its tokens' place in
                `stored.token_ids`), and whether it is the hash's first copy.

        Returns:
            The events to queue instead (none if every block is a copy).

        """
        assert len(copies) == len(stored.block_hashes)
        if all(first for _, first in copies):
            return [stored]
        size = stored.block_size
        events = []
        start = 0
        while start < len(copies):
            if not copies[start][1]:
                start += 1
                continue
            end = start + 1
            while end < len(copies) and copies[end][1]:
                end += 1
            fields = {
                "block_hashes": stored.block_hashes[start:end],
                "parent_block_hash": (
                    stored.block_hashes[start - 1]
                    if start
                    else stored.parent_block_hash
                ),
                "token_ids": stored.token_ids[
                    copies[start][0] * size : (copies[end - 1][0] + 1) * size
                ],
            }
            for name in ("extra_keys", "lookahead_token_ids"):
                per_block = getattr(stored, name, None)
                if per_block is not None:
                    fields[name] = per_block[start:end]
            events.append(msgspec.structs.replace(stored, **fields))
            start = end
        return events

    def remove_uncommitted_entry(self, entry: UncommittedEntry) -> bool:
        """Remove one uncommitted prefix-cache entry, and only that one.

        Other blocks cached under the same hash are kept. A primary hash takes
        the block's secondary (partial) hashes with it: they were registered
        on top of the same unwritten content. Hashes are compared by identity:
        a block evicted and re-cached since holds an equal hash object, not
        this one, and keeps it.

        Args:
            entry: The entry, as recorded in `uncommitted_entries`.

        Returns:
            True if the entry was still registered and is now removed.

        """
        block_hash, block, _ = entry
        if block.block_hash is block_hash:
            removed_hashes = self._remove_cached_block_hashes(block)
        else:
            hashes = self.cached_block_hashes_by_block.get(block.block_id)
            if not hashes or not any(h is block_hash for h in hashes):
                return False
            if self.cached_block_hash_to_block.pop(block_hash, block.block_id) is None:
                return False
            hashes.discard(block_hash)
            if not hashes:
                del self.cached_block_hashes_by_block[block.block_id]
            removed_hashes = [block_hash]
        self._emit_block_removed_events(removed_hashes)
        return bool(removed_hashes)

    @staticmethod
    def runs_to_cache(
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
    ) -> list[tuple[int, int]] | None:
        """The runs of `blocks[num_cached_blocks:num_full_blocks]` to cache, around
        blocks already cached as the full block they are about to become.

        Only a failed KV load's rollback leaves such blocks (see
        `FailedKVLoads`): it removes the loader's entries from its first failed
        block on but keeps those of later blocks that loaded fine, and rewinds
        the loader's cached-block count to the first removed block, so that the
        loader caches its recomputed blocks again. The kept blocks hold valid KV
        under their entry already; caching them again would register the same
        hash twice.

        Args:
            blocks: All blocks of the request in one KV cache group.
            num_cached_blocks: The blocks it has cached.
            num_full_blocks: The blocks it will have cached.
            block_size: Tokens per block of the group.

        Returns:
            None if no block is kept (the common case: cache the whole range),
            else the `[start, end)` runs between kept blocks, in order.

        """
        kept = [
            index
            for index in range(num_cached_blocks, num_full_blocks)
            if blocks[index].block_hash is not None
            and blocks[index].block_hash_num_tokens == (index + 1) * block_size
        ]
        if not kept:
            return None
        runs = []
        start = num_cached_blocks
        for index in [*kept, num_full_blocks]:
            if start < index:
                runs.append((start, index))
            start = index + 1
        return runs

    def cache_around_kept_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: list[bool] | None,
    ) -> bool:
        """`cache_full_blocks` run by run around the kept blocks (`runs_to_cache`).

        Returns:
            False, having done nothing, if no block is kept: the caller caches
            the whole range itself.

        """
        runs = self.runs_to_cache(
            blocks, num_cached_blocks, num_full_blocks, block_size
        )
        if runs is None:
            return False
        for start, end in runs:
            mask = block_mask
            if mask is not None:
                mask = mask[start - num_cached_blocks : end - num_cached_blocks]
            self.cache_full_blocks(
                request, blocks, start, end, block_size, kv_cache_group_id, mask
            )
        return True
