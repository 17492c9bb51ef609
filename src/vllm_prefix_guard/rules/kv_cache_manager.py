# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the upstream series adds to vLLM's `KVCacheManager`, verbatim."""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator


class CachedBlockRewind:
    """`KVCacheManager.rewind_num_cached_blocks`, as the series adds it."""

    if TYPE_CHECKING:
        block_pool: BlockPool
        coordinator: KVCacheCoordinator

    def rewind_num_cached_blocks(self, uncached: dict[str, set[int]]) -> None:
        """Let requests whose entries were removed cache their blocks again
        once recomputed: each group's count of a request's cached blocks is
        lowered to its first uncached block, around the blocks after it that
        kept their entry (`BlockPool.kept_block_owners`; freed ones leave).

        Args:
            uncached: Request ID -> IDs of its blocks that lost their entry.

        """
        managers = self.coordinator.single_type_managers
        owners = self.block_pool.kept_block_owners
        owners -= {o for o in owners if o[0] not in managers[o[1]].req_to_blocks}
        for group_id, manager in enumerate(managers):
            for req_id, block_ids in uncached.items():
                blocks = manager.req_to_blocks.get(req_id)
                num_cached_blocks = manager.num_cached_block.get(req_id)
                if not blocks or num_cached_blocks is None:
                    continue
                for index, block in enumerate(blocks[:num_cached_blocks]):
                    if block.block_id in block_ids:
                        manager.num_cached_block[req_id] = index
                        owners.add((req_id, group_id))
                        break
