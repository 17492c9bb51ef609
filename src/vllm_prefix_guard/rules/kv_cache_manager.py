# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the upstream series adds to vLLM's `KVCacheManager`, verbatim."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator


class CachedBlockRewind:
    """`KVCacheManager.rewind_num_cached_blocks`, as the series adds it."""

    if TYPE_CHECKING:
        coordinator: KVCacheCoordinator

    def rewind_num_cached_blocks(self, uncached: dict[str, set[int]]) -> None:
        """Let requests whose entries were removed cache their blocks again
        once recomputed: each group's count of a request's cached blocks is
        lowered to its first uncached block. Blocks after it that kept their
        entry are cached around (`BlockPool.cache_around_kept_blocks`).

        Args:
            uncached: Request ID -> IDs of its blocks whose entries were
                removed.

        """
        for manager in self.coordinator.single_type_managers:
            for req_id, block_ids in uncached.items():
                blocks = manager.req_to_blocks.get(req_id)
                num_cached_blocks = manager.num_cached_block.get(req_id)
                if not blocks or num_cached_blocks is None:
                    continue
                for index, block in enumerate(blocks[:num_cached_blocks]):
                    if block.block_id in block_ids:
                        manager.num_cached_block[req_id] = index
                        break
