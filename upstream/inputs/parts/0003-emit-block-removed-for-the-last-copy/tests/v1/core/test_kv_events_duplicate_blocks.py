# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""KV events when several blocks are cached under one hash.

Requests that compute the same prefix concurrently each fill a block of their
own, so `BlockHashToBlockMap` keeps several blocks per hash. A `BlockRemoved`
event tells consumers (KV-aware routers) that the engine no longer caches the
hash: it is due only when the last of those blocks loses it. vLLM PR #55092
(open) reports the eviction shape; the same holds for the removal of an
uncommitted entry.
"""

import pytest

from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import init_none_hash, make_block_hash_with_group_id

from .test_prefix_caching import (
    make_kv_cache_config,
    make_kv_cache_manager,
    make_request,
)

pytestmark = pytest.mark.cpu_test

BLOCK_SIZE = 16
PROMPT = list(range(2 * BLOCK_SIZE))


@pytest.fixture(autouse=True)
def _init_none_hash():
    init_none_hash(sha256)


def two_copies(num_blocks: int = 8) -> tuple[KVCacheManager, list[int], list[int]]:
    """A manager whose prefix cache holds `PROMPT`'s two blocks twice: two
    requests computed it, each into blocks of its own, and finished."""
    manager = make_kv_cache_manager(
        make_kv_cache_config(BLOCK_SIZE, num_blocks),
        max_model_len=8 * BLOCK_SIZE,
        enable_caching=True,
        hash_block_size=BLOCK_SIZE,
        enable_kv_cache_events=True,
    )
    block_ids = []
    for request_id in ("a", "b"):
        request = make_request(request_id, PROMPT, BLOCK_SIZE, sha256)
        # Both compute the prompt (no lookup between them, as in one batch).
        assert manager.allocate_slots(request, len(PROMPT)) is not None
        block_ids.append(list(manager.get_block_ids(request_id)[0]))
        manager.free(request)
    copies_a, copies_b = block_ids
    assert set(copies_a).isdisjoint(copies_b)
    return manager, copies_a, copies_b


def removed_hashes(manager: KVCacheManager) -> list:
    return [
        block_hash
        for event in manager.take_events()
        if isinstance(event, BlockRemoved)
        for block_hash in event.block_hashes
    ]


def num_hit_tokens(manager: KVCacheManager) -> int:
    probe = make_request("probe", PROMPT + [0], BLOCK_SIZE, sha256)
    return manager.get_computed_blocks(probe)[1]


def test_a_hash_is_stored_and_removed_once_whatever_its_copies():
    """#55092: evicting one of two blocks cached under a hash keeps the hash
    cached (the other block still hits), so no `BlockRemoved` is emitted;
    evicting the last one emits it, once. Likewise `BlockStored` is emitted
    when the first copy caches the hash, not for the second: a consumer that
    keeps a set of hashes and one that counts `BlockStored` per hash (the
    event filters of NVIDIA Dynamo and llm-d) both agree with the cache."""
    manager, copies_a, copies_b = two_copies()
    stored = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in stored] == [2]  # The first copy only.

    manager.block_pool.evict_blocks(set(copies_a))
    assert removed_hashes(manager) == []
    assert num_hit_tokens(manager) == len(PROMPT)

    manager.block_pool.evict_blocks(set(copies_b))
    assert len(removed_hashes(manager)) == 2
    assert num_hit_tokens(manager) == 0


def test_block_stored_names_the_blocks_that_cache_a_hash_first():
    """A request that computes `PROMPT` again and one block more caches a
    third copy of the prompt's blocks and the first of its last: its
    `BlockStored` lists that block alone, its parent the prompt's last hash."""
    manager, _, _ = two_copies()
    (prompt_stored,) = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    tail = list(range(100, 100 + BLOCK_SIZE))
    request = make_request("c", PROMPT + tail, BLOCK_SIZE, sha256)
    assert manager.allocate_slots(request, len(PROMPT) + BLOCK_SIZE) is not None

    (stored,) = [e for e in manager.take_events() if isinstance(e, BlockStored)]
    assert len(stored.block_hashes) == 1
    assert stored.parent_block_hash == prompt_stored.block_hashes[-1]
    assert list(stored.token_ids) == tail


def test_removing_one_uncommitted_copy_emits_no_block_removed():
    """The same for an uncommitted entry removed exactly (its step never
    wrote its block): the hash stays cached under the other copy."""
    manager, copies_a, copies_b = two_copies()
    manager.take_events()
    pool = manager.block_pool
    for block_ids in (copies_a, copies_b):
        block = pool.blocks[block_ids[0]]
        entry = (block.block_hash, block, BLOCK_SIZE)
        assert pool.remove_uncommitted_entry(entry)
        expected = [] if block_ids is copies_a else [block.block_hash]
        assert len(removed_hashes(manager)) == len(expected)
    first = make_block_hash_with_group_id(
        make_request("probe", PROMPT, BLOCK_SIZE, sha256).block_hashes[0], 0
    )
    assert pool.cached_block_hash_to_block.get_one_block(first) is None
