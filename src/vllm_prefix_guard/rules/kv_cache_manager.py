# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""What the upstream series adds to vLLM's `KVCacheManager`, verbatim.

`upstream/series.py` copies the methods of `CachedBlockRewind` into
`KVCacheManager`; the plugin installs them on vLLM's class. Nothing here may
differ between the two.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator


class CachedBlockRewind:
    """`KVCacheManager.rewind_num_cached_blocks`, as the series adds it."""

    if TYPE_CHECKING:
        coordinator: KVCacheCoordinator

    def rewind_num_cached_blocks(self, uncached: dict[str, set[int]]) -> None:
        """Let requests that keep their blocks cache them again once their KV
        is recomputed, after their entries were removed from the prefix cache.

        Each KV cache group counts the blocks of a request it has cached and
        never caches those again; this lowers the count to the first uncached
        block. Blocks after it that kept their entry (they loaded fine after a
        failed block) are cached around: `BlockPool.runs_to_cache`.

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
                first = next(
                    (
                        i
                        for i, block in enumerate(blocks[:num_cached_blocks])
                        if block.block_id in block_ids
                    ),
                    None,
                )
                if first is not None:
                    manager.num_cached_block[req_id] = first
