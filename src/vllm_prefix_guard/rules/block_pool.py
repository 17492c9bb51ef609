# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the upstream series adds to vLLM's `BlockPool`, verbatim.

`upstream/tools/series.py` copies the type aliases into `vllm/v1/core/block_pool.py`
and the methods of `BlockPoolAdditions` into `BlockPool`; the plugin's pool
mixin inherits them.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import msgspec
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import BlockHashWithGroupId, KVCacheBlock
from vllm.v1.request import Request

# Type-checked as vLLM's `BlockPool`, a plain mixin at run time.
if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
else:
    BlockPool = object

# A prefix-cache entry registered before its KV is written: the hash, the block,
# and the number of tokens the hash names.
UncommittedEntry = tuple[BlockHashWithGroupId, KVCacheBlock, int | None]

# The entries one scheduler step registered, per request ID; None for entries
# made on no request's behalf (a copy-on-write move of a Mamba checkpoint).
StepCacheEntries = dict[str | None, list[UncommittedEntry]]


class BlockPoolAdditions(BlockPool):
    """The methods the series adds to `BlockPool`."""

    if TYPE_CHECKING:
        # (Request ID, KV cache group ID) of each loader rewound below blocks
        # that kept their entry (`KVCacheManager.rewind_num_cached_blocks`).
        kept_block_owners: set[tuple[str, int]]

    def uncached_block_hashes(
        self, block_hashes: list[BlockHashWithGroupId]
    ) -> list[BlockHashWithGroupId]:
        """The hashes among `block_hashes` (each just removed from one block)
        that no block caches any more.

        Requests that compute one prefix concurrently fill a block each under
        one hash. KV events describe the hash: `BlockRemoved` is due when its
        last block loses it, as `BlockStored` is when its first caches it
        (`first_copy_events`), so that consumers keeping a set of hashes and
        consumers counting them both match the cache.
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
        """`stored` (one `cache_full_blocks` call's event) less the blocks whose
        hash another block caches already: one event per run of the others,
        each naming the block before it as its parent.

        Args:
            stored: The event.
            copies: Per block of `stored`: its position among the blocks the
                call cached (in `stored.token_ids`), and whether it is the
                hash's first copy.

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
        """Remove one uncommitted entry, and only that one; False if it was no
        longer cached.

        Other blocks cached under the same hash stay. A primary hash takes the
        block's secondary (partial) hashes with it: they name the same unwritten
        content. Hashes compare by identity: a block evicted and cached again
        since holds an equal hash object, not this one.
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
        """`cache_full_blocks` run by run around blocks of the range already
        cached as the full block they are about to become; False, having done
        nothing, if there are none.

        Only a failed KV load's rollback leaves such blocks: it keeps the
        entries of blocks that loaded fine after a failed one and rewinds the
        loader's cached-block count to that one, making it a kept-block owner
        (the caller checks that first) until its last kept block is passed.
        """
        owner = (request.request_id, kv_cache_group_id)
        if owner not in self.kept_block_owners:
            return False
        kept = [
            index
            for index in range(num_cached_blocks, len(blocks))
            if blocks[index].block_hash is not None
            and blocks[index].block_hash_num_tokens == (index + 1) * block_size
        ]
        if not kept or kept[-1] < num_full_blocks:
            self.kept_block_owners.discard(owner)
        if not kept or kept[0] >= num_full_blocks:
            return False
        start = num_cached_blocks
        for end in [*(i for i in kept if i < num_full_blocks), num_full_blocks]:
            if start < end:
                mask = block_mask
                if mask is not None:
                    mask = mask[start - num_cached_blocks : end - num_cached_blocks]
                self.cache_full_blocks(
                    request, blocks, start, end, block_size, kv_cache_group_id, mask
                )
            start = end + 1
        return True
