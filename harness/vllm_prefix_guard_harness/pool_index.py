"""What vLLM's prefix-cache index (``BlockHashToBlockMap``) holds, on every tested release.

The harness compares the index with what it believes (the explorer's state digest, KV-event
consumers, layouts that pick a key cached twice); the guard itself only calls the index's
public methods. Its private layout differs by release: vLLM 0.30-0.33 map a key to its
block, or to ``{block id: block}`` once several blocks cache it; 0.34 maps a key to one
block id and keeps every id of a key cached several times in ``_dup_ids``.
"""

from __future__ import annotations

from typing import Any


def cached_block_ids(index: Any) -> dict[Any, tuple[int, ...]]:
    """Each key of ``index`` -> the IDs of the blocks cached under it, in insertion order."""
    duplicates = getattr(index, "_dup_ids", None)
    if duplicates is not None:  # 0.34: block IDs
        return {
            key: tuple(duplicates[key]) if key in duplicates else (block_id,)
            for key, block_id in index._cache.items()
        }
    return {  # 0.30-0.33: blocks
        key: tuple(held) if isinstance(held, dict) else (held.block_id,)
        for key, held in index._cache.items()
    }


def keys_cached_twice(pool: Any) -> dict[Any, list[Any]]:
    """Each key several blocks of ``pool`` cache -> those blocks, in insertion order."""
    return {
        key: [pool.blocks[block_id] for block_id in block_ids]
        for key, block_ids in cached_block_ids(pool.cached_block_hash_to_block).items()
        if len(block_ids) > 1
    }
