"""Start-up checks: every vLLM internal any guard path touches, checked before the first patch.

Each internal in ``targets.INTERNALS`` is removed or renamed on the real, installed vLLM
(a method set to None, a dataclass field renamed, a constructor's ``self.x = ...``
rewritten to store another name) and ``apply()`` must fail with that internal's name,
patching nothing.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import linecache
import re
import textwrap
import types
from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from vllm_prefix_guard import plugin, targets
from vllm_prefix_guard.doctor import run_checks
from vllm_prefix_guard.errors import GuardUnsupportedError
from vllm_prefix_guard.hooks import GUARD_ATTR
from vllm_prefix_guard.targets import Internal, Kind

STOCK_SCHEDULER = dict(vars(Scheduler))
#: The scheduler methods the patch table wraps, as the start-up checks see them.
SCHEDULER_HOOKS = tuple(i for i in targets.patch_internals() if i.owner == "Scheduler")


def _rename_stores(function: Any, name: str, renamed: str) -> Any:
    """A copy of ``function`` whose source stores ``renamed`` wherever it stored ``name``
    on its first parameter (the guard reads constructors from their source)."""
    source = textwrap.dedent(inspect.getsource(function))
    this = next(iter(inspect.signature(function).parameters))
    source = re.sub(rf"\b{this}\.{name}\b", f"{this}.{renamed}", source)
    filename = f"/renamed/{function.__module__}/{function.__qualname__}.py"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = dict(function.__globals__)
    exec(compile(source, filename, "exec"), namespace)
    copy = namespace[function.__name__]
    copy.__qualname__ = function.__qualname__
    return copy


def remove_from_vllm(monkeypatch: pytest.MonkeyPatch, internal: Internal) -> None:
    """Make the installed vLLM lack ``internal``, the way a release renaming it would."""
    module = importlib.import_module(internal.module)
    owner: Any = targets.resolve(internal.module, internal.owner) if internal.owner else module
    name, renamed = internal.name, internal.name + "_renamed"
    if internal.kind is Kind.NAME:
        monkeypatch.delattr(owner, name)
        return
    if internal.kind is Kind.CALLABLE:
        monkeypatch.setattr(owner, name, None)
        return
    if dataclasses.is_dataclass(owner):
        fields = dict(owner.__dataclass_fields__)
        if name in fields:
            fields[renamed] = copy.copy(fields.pop(name))
            fields[renamed].name = renamed
            monkeypatch.setattr(owner, "__dataclass_fields__", fields)
    for klass in owner.__mro__:
        if name in vars(klass):
            monkeypatch.delattr(klass, name)
        annotations = vars(klass).get("__annotations__", {})
        if name in annotations:
            renamed_annotations = {(renamed if k == name else k): v for k, v in annotations.items()}
            monkeypatch.setattr(klass, "__annotations__", renamed_annotations)
        init = vars(klass).get("__init__")
        if inspect.isfunction(init) and name in targets.constructor_stores(klass):
            monkeypatch.setattr(klass, "__init__", _rename_stores(init, name, renamed))


@pytest.mark.parametrize("internal", targets.INTERNALS, ids=lambda i: i.path)
def test_each_internal_is_checked_before_the_first_patch(
    monkeypatch: pytest.MonkeyPatch, internal: Internal
) -> None:
    targets.check(internal)  # present on the installed vLLM
    remove_from_vllm(monkeypatch, internal)
    with pytest.raises(GuardUnsupportedError) as excinfo:
        plugin.apply()
    message = str(excinfo.value)
    assert internal.qualname in message and "VLLM_PREFIX_GUARD=0" in message
    assert not plugin.is_applied()
    monkeypatch.undo()
    assert dict(vars(Scheduler)) == STOCK_SCHEDULER  # nothing was patched


def test_a_vllm_with_part_of_what_the_table_adds_stops_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM that has a method of the series' (and not the whole series, which the guard
    steps aside for) is refused before the first patch, not half-patched."""
    from vllm.v1.core.block_pool import BlockPool

    monkeypatch.setattr(BlockPool, "cache_around_kept_blocks", lambda self: None, raising=False)
    with pytest.raises(GuardUnsupportedError, match="cache_around_kept_blocks exists already"):
        plugin.apply()
    assert not plugin.is_applied()
    assert dict(vars(Scheduler)) == STOCK_SCHEDULER


def test_state_group_pool_calls_are_all_reviewed() -> None:
    """vLLM's MambaManager registers state blocks through the pool methods the guard
    wraps; doctor names the calls."""
    calls = targets.check_state_groups()
    assert {"cache_partial_block", "move_block_hashes", "_maybe_evict_cached_block"} <= set(calls)
    [state] = [c for c in run_checks(self_test=False) if "MambaManager" in c.name]
    assert state.status == "ok" and "cache_partial_block" in state.detail


_STATE_GROUP_POOL_CALLS_0_30 = frozenset(
    {
        "_maybe_evict_cached_block",
        "cache_partial_block",
        "free_blocks",
        "get_cached_block",
        "get_new_blocks",
        "hash_block_size",
        "is_block_writable",
        "move_block_hashes",
        "null_block",
        "num_gpu_blocks",
    }
)
#: What vLLM's MambaManager does to the pool on each tested release (read from its source
#: by ``targets.pool_calls``). A release that changes it changes this table, reviewed
#: against ``targets.STATE_GROUP_POOL_CALLS``.
STATE_GROUP_POOL_CALLS_BY_RELEASE = {
    "0.30": _STATE_GROUP_POOL_CALLS_0_30,
    "0.31": _STATE_GROUP_POOL_CALLS_0_30,
    "0.32": _STATE_GROUP_POOL_CALLS_0_30,
    "0.33": _STATE_GROUP_POOL_CALLS_0_30 | {"num_hash_lookahead_tokens"},
    "0.34": _STATE_GROUP_POOL_CALLS_0_30 | {"num_hash_lookahead_tokens"},
}


def test_state_group_pool_calls_are_pinned_per_release() -> None:
    release = ".".join(targets.vllm_version().split(".")[:2])
    assert set(targets.check_state_groups()) == STATE_GROUP_POOL_CALLS_BY_RELEASE[release]


def test_pool_calls_through_a_parameter_are_found() -> None:
    """``block_pool.x`` on a parameter (a classmethod's ``block_pool``) counts like
    ``self.block_pool.x``: read from the source, whatever opcodes load a parameter
    (CPython 3.14: ``LOAD_FAST_BORROW``); the bytecode reading missed these."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager

    assert {"get_cached_block", "null_block"} <= targets.pool_calls(SlidingWindowManager)


def test_constructor_stores_are_those_on_self_only() -> None:
    """``manager.x = ...`` in a constructor stores nothing on the object built (the
    bytecode reading counted every ``STORE_ATTR``)."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    stores = targets.constructor_stores(KVCacheCoordinator)
    assert "single_type_managers" in stores
    assert "drop_eagle_checkpoint_block" not in stores


def test_an_unreviewed_state_group_pool_call_stops_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A vLLM whose state-group manager reaches the pool some other way (here: writing
    the hash index directly) could cache a state block behind the guard's back."""
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    def cache_blocks(self: Any, request: Any, num_tokens: int) -> None:
        self.block_pool.cached_block_hash_to_block.insert(request, num_tokens)

    monkeypatch.setattr(MambaManager, "cache_blocks", cache_blocks)
    with pytest.raises(GuardUnsupportedError, match=r"BlockPool\.cached_block_hash_to_block"):
        plugin.apply()
    assert not plugin.is_applied()


def test_a_constructor_wrapped_without_functools_wraps_still_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """kvcached (its ``.pth`` patches during ``import vllm``, before the plugin loads) wraps
    ``KVCacheCoordinator.__init__`` in a closure without ``__wrapped__``: the attributes
    vLLM's constructor stores are still found, through the closure."""
    from vllm.v1.core.kv_cache_coordinator import KVCacheCoordinator

    original_init = KVCacheCoordinator.__init__

    def _patched_init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheCoordinator, "__init__", _patched_init)
    assert not hasattr(_patched_init, "__wrapped__")
    assert plugin.apply()
    plugin.undo()
    # A renamed store behind such a wrapper still stops start-up.
    renamed = _rename_stores(original_init, "single_type_managers", "managers_renamed")

    def _patched_renamed(self: Any, *args: Any, **kwargs: Any) -> None:
        renamed(self, *args, **kwargs)

    monkeypatch.setattr(KVCacheCoordinator, "__init__", _patched_renamed)
    with pytest.raises(GuardUnsupportedError, match="single_type_managers"):
        plugin.apply()


def test_wrappers_keep_the_originals_identity_and_doctor_passes_after_apply() -> None:
    originals = {t.name: Scheduler.__dict__[t.name] for t in SCHEDULER_HOOKS}
    plugin.apply()
    for name, original in originals.items():
        wrapper = Scheduler.__dict__[name]
        assert wrapper is not original and wrapper.__wrapped__ is original
        assert wrapper.__qualname__ == original.__qualname__
        assert wrapper.__doc__ == original.__doc__
        assert inspect.signature(wrapper) == inspect.signature(original)
    failed = [c for c in run_checks(self_test=False) if c.failed]
    assert failed == []


@pytest.mark.parametrize("hook", SCHEDULER_HOOKS[1:], ids=lambda i: i.name)
def test_wrappers_run_the_original_on_a_scheduler_without_a_guard(
    monkeypatch: pytest.MonkeyPatch, hook: Internal
) -> None:
    """vLLM's own tests call scheduler methods with stand-in objects (no ``__init__`` of
    ours ever ran); the wrapper must behave exactly like the original there."""
    calls: list[tuple[Any, ...]] = []

    @functools.wraps(Scheduler.__dict__[hook.name])  # same signature: the checks pass
    def original(self: Any, *args: Any, **kwargs: Any) -> str:
        calls.append((self, *args))
        return "original"

    monkeypatch.setattr(Scheduler, hook.name, original)
    plugin.apply()
    try:
        stand_in = types.SimpleNamespace()
        assert not hasattr(stand_in, GUARD_ATTR)
        arguments = [object() for _ in hook.params]
        assert getattr(Scheduler, hook.name)(stand_in, *arguments) == "original"
        assert calls == [(stand_in, *arguments)]
    finally:
        plugin.undo()  # before monkeypatch restores vLLM's method under the wrapper


def _callers_of(attribute: str) -> set[str]:
    """``module:function`` of every function in vLLM's ``v1`` package whose source calls
    a method named ``attribute``."""
    import ast
    import pathlib

    import vllm.v1

    root = pathlib.Path(vllm.v1.__file__).parent
    callers = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            if any(
                isinstance(node, ast.Call) and getattr(node.func, "attr", None) == attribute
                for node in ast.walk(function)
            ):
                callers.add(f"{path.relative_to(root).with_suffix('')}:{function.name}")
    return callers


def test_every_registration_goes_through_a_wrapped_method() -> None:
    """The pool wrappers record what ``cache_full_blocks``, ``cache_partial_block`` and
    ``move_block_hashes`` register, not ``_insert_block_hash``: pinned on each tested
    release, every other caller of it is vLLM's CPU offloading tier, on its own pool
    (``cpu_block_pool``), which no guard attaches to."""
    assert _callers_of("_insert_block_hash") == {
        "core/block_pool:cache_full_blocks",
        "core/block_pool:cache_partial_block",
        "core/block_pool:move_block_hashes",
        "simple_kv_offload/manager:_process_store_completion",
    }
