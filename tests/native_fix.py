"""A stand-in for vLLM's own fix (upstream/prefix-cache-commit.patch) on a stock vLLM:
its names, in its shape or another, for the guard's detection to find."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from vllm.v1.core.block_pool import BlockPool
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


#: The patch's methods, as stand-ins taking the same parameters.
METHODS: dict[str, Any] = {
    "begin_step": lambda self: None,
    "end_step": lambda self, scheduler_output: None,
    "commit_step": lambda self, scheduler_output: None,
    "rollback_preempted": lambda self, request_id, num_written_tokens: None,
    "rollback_failed_loads": lambda self, output, invalid_block_ids, running_req_ids: None,
}


def simulate_native_fix(
    monkeypatch: pytest.MonkeyPatch,
    methods: dict[str, Any] | None = None,
    remove_entry: Any = lambda self, entry: True,
    wired: bool = True,
) -> None:
    """Give stock vLLM the patch's API: an ``UncommittedPrefixCache`` with ``methods``
    (default: :data:`METHODS`), ``BlockPool.remove_uncommitted_entry`` (None: absent)
    and, if ``wired``, ``Scheduler.uncommitted_prefix_cache``."""
    module = types.ModuleType(targets.UNCOMMITTED)
    module.UncommittedPrefixCache = type(  # type: ignore[attr-defined]
        "UncommittedPrefixCache", (), dict(METHODS if methods is None else methods)
    )
    monkeypatch.setitem(sys.modules, targets.UNCOMMITTED, module)
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
