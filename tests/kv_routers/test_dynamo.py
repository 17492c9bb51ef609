"""NVIDIA Dynamo's own KV-router code agrees with the guarded engine's prefix cache.

``scheduler_lane.py`` runs vLLM's real scheduler publishing its KV events on ZMQ to Dynamo's
``KvEventPublisher`` (its ``EventDedupFilter`` counts ``BlockStored`` per hash) relaying to a
``KvRouter``, and to Dynamo's standalone indexer (a set per worker, no filter). One prefix
block is cached by two physical copies (greedy twins), each copy is evicted, and the block
is cached and evicted twice more. At each checkpoint both consumers are asked how many
leading blocks of the sequence they credit the engine with, beside what the engine holds:

- guarded, both agree with the engine at every checkpoint;
- stock vLLM's ``BlockRemoved`` per copy makes the indexer forget a block the other copy
  still serves (its counting router is right);
- a guard that announced each copy (``BlockStored`` per copy, ``BlockRemoved`` for the last
  only: the guard before this rule) leaves Dynamo's router crediting a block the engine no
  longer holds, after every eviction.

Needs ``ai-dynamo-runtime`` (``nox -s kv-routers`` installs it); each lane runs in a process
of its own (one Dynamo runtime per process).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("dynamo.llm", reason="needs ai-dynamo-runtime (nox -s kv-routers)")

LANE = Path(__file__).resolve().parent / "scheduler_lane.py"


@cache
def lane(name: str, scenario: str = "copies") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(LANE), name, scenario], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["violations"] == 0
    return result


def wrong(result: dict[str, Any], consumer: str) -> list[str]:
    """The checkpoints at which ``consumer`` credits another number of blocks than the
    engine holds."""
    return [c["name"] for c in result["checkpoints"] if c[consumer] != c["engine"]]


def test_both_dynamo_consumers_agree_with_the_guarded_engine() -> None:
    result = lane("guard")
    assert len(result["checkpoints"]) == 7
    assert wrong(result, "router") == wrong(result, "indexer") == []


def test_stock_per_copy_removals_make_the_indexer_forget_a_served_block() -> None:
    result = lane("stock")
    assert wrong(result, "router") == []
    assert wrong(result, "indexer") == ["copy 1 of 2 of block 1 evicted"]


def test_a_stored_event_per_copy_leaves_dynamos_router_a_phantom() -> None:
    result = lane("per-copy")
    assert wrong(result, "indexer") == []
    assert wrong(result, "router") == [
        "copy 2 of 2 of block 1 evicted",
        "block 1 evicted again (1)",
        "block 1 evicted again (2)",
    ]


def test_known_limit_a_block_whose_parent_went_is_not_announced_again() -> None:
    """What the guard's stream leaves to Dynamo (docs/operations.md): block 0's copies are
    evicted while block 1 stays cached, then a request computes both again. Dynamo's radix
    tree dropped block 1 with block 0; the guard announces block 0 again but not block 1,
    which another block caches already, so both consumers credit one block where the engine
    holds two, until block 1's copies are gone. Stock announces every copy, so they credit
    two. An under-credit: requests are routed elsewhere or recompute, never read wrong KV."""
    guarded, stock = lane("guard", "orphan"), lane("stock", "orphan")
    assert wrong(stock, "router") == wrong(stock, "indexer") == []
    last = guarded["checkpoints"][-1]
    assert last["name"] == "both computed again"
    assert (last["engine"], last["router"], last["indexer"]) == (2, 1, 1)
