"""KV events stay true for every router when one key is cached in several blocks.

KV-aware routers build their picture of an engine's prefix cache from its KV events
alone. Requests that compute the same prefix concurrently each fill a block of their
own, so one ``(block_hash, group_id)`` is cached in several blocks (what vLLM's
``BlockHashToBlockMap`` keeps; kvcached #401/#402). Routers read the stream two ways: as
a set of announced keys (vllm-router, NVIDIA Dynamo's standalone indexer), or counting
``BlockStored`` per key and letting ``BlockRemoved`` through only when the count falls to
0 (Dynamo's and llm-d's ``EventDedupFilter``). Both agree with the cache only if
``BlockStored`` comes when the first block caches the key and ``BlockRemoved`` when the
last one loses it. Two shapes (``tests/layouts.py``; ``tests/kvcached`` runs them on
kvcached's pool), checked by both consumers replayed from the stream against the pool's
index (:class:`~vllm_prefix_guard_harness.kv_events.KVEventReplay`):

- vLLM evicts one copy for reuse, then the other (stock vLLM announces the key removed
  while the other copy serves it, open vLLM PR #55092's shape: the set consumer forgets
  it; its per-copy ``BlockStored`` keeps the counting consumer right);
- the guard rolls back one copy (a request preempted in the ``schedule()`` that
  registered it) while another request's block keeps the key.
"""

from __future__ import annotations

import pytest

import layouts
from vllm_prefix_guard import plugin, pool


def test_evicting_one_copy_keeps_the_key_announced(mode: str) -> None:
    shape = layouts.kv_events_eviction_shape()
    assert shape["violations"] == 0 and shape["wrong_before"] == (0, 0)
    assert shape["still_hits"]  # the other copy still serves the prefix
    if mode == "stock":
        # The set consumer is told the key is gone; the counting one still counts a copy.
        assert shape["wrong_after_first"] == (1, 0)
        return
    assert shape["wrong_after_first"] == (0, 0)
    assert shape["wrong_after_second"] == (0, 0) and shape["gone_after_second"]


def test_a_stored_event_per_copy_leaves_a_counting_router_a_phantom(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The guard without its ``BlockStored`` rule (one per copy, as stock emits them,
    beside ``BlockRemoved`` for the last copy only): once both copies are evicted a
    counting consumer still credits the engine with the key, until ``AllBlocksCleared``."""

    monkeypatch.setattr(pool, "store_first_copies", lambda *args: None)
    plugin.apply()
    shape = layouts.kv_events_eviction_shape()
    assert shape["wrong_after_first"] == (0, 0)
    assert shape["wrong_after_second"] == (0, 1) and shape["gone_after_second"]


def test_rolling_back_one_copy_keeps_the_key_announced(mode: str) -> None:
    shape = layouts.kv_events_rollback_shape()
    assert shape["copies_after_preemption"] is not None, "the layout no longer preempts Y"
    if mode == "stock":
        # Y's copy, never to be written, stays cached until W's allocation evicts it in
        # that same call, and that eviction announces the key X still caches as removed.
        assert shape["disagreements"]
        return
    assert shape["copies_after_preemption"] == 1 and shape["violations"] == 0
    assert shape["disagreements"] == [], (
        f"the consumer disagreed with the cache after {shape['disagreements']}"
    )
