"""A stand-in for vLLM's own fix (the upstream series) on a stock vLLM: its names, in its
shape or another, for the guard's detection to find."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_prefix_guard import targets

#: The installed vLLM carries its own fix (``nox -s upstream`` runs the project's
#: regression tests on vLLM patched with it): its "stock" is not stock, the guard steps
#: aside, and a test judges the fix by the oracle alone.
INSTALLED = targets.native_fix().complete


def guard_only(reason: str) -> pytest.MarkDecorator:
    """Skip a test on a vLLM with its own fix: it checks the guard's machinery, or a case
    vLLM's own fix leaves out on purpose (``reason``)."""
    return pytest.mark.skipif(INSTALLED, reason=f"vLLM carries its own fix: {reason}")


#: The series' ``UncommittedPrefixCache`` methods, as stand-ins taking the same parameters.
METHODS: dict[str, Any] = {
    "begin_step": lambda self: None,
    "end_step": lambda self, scheduler_output: None,
    "commit_step": lambda self, scheduler_output: None,
    "reset": lambda self: None,
    "rollback_preempted": lambda self, req_id, num_written_tokens: None,
    "drop_steps_in_flight": lambda self: None,
}


def simulate_native_fix(
    monkeypatch: pytest.MonkeyPatch,
    methods: dict[str, Any] | None = None,
    remove_entry: Any = lambda self, entry: True,
    wired: bool = True,
    failed_kv_loads: bool = True,
    kv_events: bool = True,
) -> None:
    """Give stock vLLM the series' API: an ``UncommittedPrefixCache`` with ``methods``
    (default: :data:`METHODS`), ``BlockPool.remove_uncommitted_entry`` (None: absent),
    if ``wired`` ``Scheduler.uncommitted_prefix_cache``, and if ``failed_kv_loads`` its
    part 2: ``FailedKVLoads.roll_back``, ``reads_bad_kv`` and ``drop_stale_output`` and
    ``KVCacheManager.rewind_num_cached_blocks``, and if ``kv_events`` its part 3:
    ``BlockPool.uncached_block_hashes``."""
    if methods is None:
        methods = dict(METHODS)
    module = types.ModuleType(targets.UNCOMMITTED)
    module.UncommittedPrefixCache = type(  # type: ignore[attr-defined]
        "UncommittedPrefixCache", (), dict(methods)
    )
    monkeypatch.setitem(sys.modules, targets.UNCOMMITTED, module)
    if failed_kv_loads:
        module = types.ModuleType(targets.FAILED_KV_LOADS)
        module.FailedKVLoads = type(  # type: ignore[attr-defined]
            "FailedKVLoads",
            (),
            {
                "roll_back": lambda self, scheduler_output, invalid_block_ids: None,
                "reads_bad_kv": lambda self, request: False,
                "drop_stale_output": lambda self, requests: 0,
            },
        )
        monkeypatch.setitem(sys.modules, targets.FAILED_KV_LOADS, module)
        monkeypatch.setattr(
            KVCacheManager,
            "rewind_num_cached_blocks",
            lambda self, uncached: None,
            raising=False,
        )
    if kv_events:
        monkeypatch.setattr(
            BlockPool, "uncached_block_hashes", lambda self, block_hashes: [], raising=False
        )
    if remove_entry is not None:
        monkeypatch.setattr(BlockPool, "remove_uncommitted_entry", remove_entry, raising=False)
    if wired:
        monkeypatch.setattr(Scheduler, "uncommitted_prefix_cache", object(), raising=False)


def simulate_pr43569(monkeypatch: pytest.MonkeyPatch, owner: type, *names: str) -> None:
    """Give ``owner`` (vLLM's KV cache manager or pool) PR #43569's methods."""
    shapes = {
        "begin_step": lambda self: None,
        "commit_step": lambda self: None,
        "rollback_uncommitted": lambda self, req_id: None,
    }
    for name in names or tuple(shapes):
        monkeypatch.setattr(owner, name, shapes[name], raising=False)
