"""KV events stay true when one key is cached in several blocks.

KV-aware routers build their picture of an engine's prefix cache from its KV events
alone. Requests that compute the same prefix concurrently each fill a block of their
own, so one ``(block_hash, group_id)`` is cached in several blocks (what vLLM's
``BlockHashToBlockMap`` keeps; kvcached #401/#402). ``BlockRemoved`` for the key is
then true only once the last of those blocks loses it; emitted earlier, a router routes
requests away from the engine that still holds their prefix. Two shapes
(``tests/layouts.py``; ``tests/kvcached`` runs them on kvcached's pool), checked by a
consumer replayed from the event stream against the pool's index
(:class:`~vllm_prefix_guard.diagnostics.kv_events.KVEventReplay`):

- vLLM evicts one copy for reuse (stock vLLM emits ``BlockRemoved``; open vLLM PR
  #55092's shape);
- the guard rolls back one copy (a request preempted in the ``schedule()`` that
  registered it) while another request's block keeps the key.
"""

from __future__ import annotations

import layouts


def test_evicting_one_copy_keeps_the_key_announced(mode: str) -> None:
    shape = layouts.kv_events_eviction_shape()
    assert shape["violations"] == 0 and shape["wrong_before"] == 0
    assert shape["still_hits"]  # the other copy still serves the prefix
    if mode == "stock":
        assert shape["wrong_after_first"] == 1, "stock vLLM announces the cached key as removed"
        return
    assert shape["wrong_after_first"] == 0
    assert shape["wrong_after_second"] == 0 and shape["gone_after_second"]


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
