"""Run kvcached's real vLLM integration on CPU; only its GPU allocator is faked.

Test harness code (not in the wheel). kvcached 0.1.6 cannot be built without CUDA (its
``setup.py`` asks torch for a GPU backend), so its unpacked sdist (``$KVCACHED_SRC``,
fetched by ``scripts/fetch_kvcached.py``) is put on ``sys.path`` and everything above the
allocator stays kvcached's own: the autopatch (``_patch_vllm``), ``ElasticBlockPool``
(the native-index variant kvcached builds on vLLM 0.26-0.30, its legacy class
elsewhere), the ``KVCacheCoordinator.__init__`` swap, the ``allocate_slots`` wrapper,
the ``EngineCore.__init__`` gate and the real ``kvcached.integration.vllm.interfaces``.

Faked, as kvcached's own CPU tests do (``tests/test_vllm_native_block_pool.py``,
``PhysicalPool``):

- ``kvcached.vmm_ops`` (it wraps the compiled ``kvcached._C``): inert stand-ins, so
  ``interfaces`` imports;
- ``interfaces.get_kv_cache_manager`` -> :class:`FakePhysicalAllocator`, block ids and
  nothing mapped (block 0 reserved as the null block, like ``reserve_null_block=True``;
  no ``page_allocator``, so page-aware eviction falls back to LRU order);
- ``interfaces.init_kvcached`` / ``get_world_size`` / ``shutdown_kvcached``: no GPU.

The autopatch is triggered without kvcached's ``.pth``: that file only registers
``when_imported("vllm")`` hooks importing ``kvcached.integration.vllm.autopatch``, whose
own ``when_imported("vllm") _patch_vllm`` wrapt runs at once when vLLM is already
imported. :func:`activate` sets ``ENABLE_KVCACHED=1`` and ``KVCACHED_AUTOPATCH=1``,
imports vLLM, then that module. kvcached patches process-wide and has no undo: one
interpreter per load order.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
import warnings
from typing import Any

#: kvcached's LRU cap (``KVCACHED_MAX_CACHED_TOKENS``, read when ``kvcached.utils`` is
#: imported). Its default (16000 tokens) is above every pool here, but a small cap trims
#: a preempted request's blocks on free and hides the zombie: pin it high.
MAX_CACHED_TOKENS = "1000000"

#: One fake allocator per ElasticBlockPool built, in order (scenarios inspect them).
ALLOCATORS: list[FakePhysicalAllocator] = []


class FakePhysicalAllocator:
    """kvcached's physical block allocator without a GPU: ids, nothing mapped."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        cell_size: int = 0,
        num_layers: int = 1,
        **kwargs: Any,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kwargs = kwargs
        self.free_ids = list(range(1, num_blocks))  # block 0: the reserved null block
        self.allocated: set[int] = set()
        self.freed_total = 0
        # kvcached's page-aware eviction asks for this; None -> plain LRU victims.
        self.page_allocator = None

    def alloc(self, count: int) -> list[int] | None:
        if count > len(self.free_ids):
            return None
        ids, self.free_ids = self.free_ids[:count], self.free_ids[count:]
        self.allocated.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for block_id in ids:
            assert block_id in self.allocated, f"double free of block {block_id}"
            self.allocated.remove(block_id)
            self.free_ids.append(block_id)
        self.freed_total += len(ids)

    def available_size(self) -> int:
        return len(self.free_ids)

    def shutdown(self) -> bool:
        return True


def _fake_vmm_ops() -> types.ModuleType:
    """Inert stand-ins for what ``kvcached.vmm_ops`` exports from ``kvcached._C``."""
    module = types.ModuleType("kvcached.vmm_ops")
    module.__doc__ = "CPU stand-in for kvcached.vmm_ops (no kvcached._C)"

    def _no_gpu(name: str) -> Any:
        def op(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(f"kvcached.vmm_ops.{name} needs the CUDA extension")

        op.__name__ = name
        return op

    for name in (
        "init_kvcached",
        "shutdown_kvcached",
        "create_kv_tensors",
        "map_to_kv_tensors",
        "unmap_from_kv_tensors",
        "map_to_kv_tensors_with_result",
        "prepare_unmap_from_kv_tensors",
        "commit_unmap_from_kv_tensors",
        "abort_unmap_from_kv_tensors",
    ):
        setattr(module, name, _no_gpu(name))
    module.kv_tensors_created = lambda *args, **kwargs: True  # type: ignore[attr-defined]
    module.PageAllocator = type("PageAllocator", (), {})  # type: ignore[attr-defined]
    module.InternalPage = type("InternalPage", (), {})  # type: ignore[attr-defined]
    return module


def source_dir() -> str:
    src = os.environ.get("KVCACHED_SRC", "")
    if not os.path.isfile(os.path.join(src, "kvcached", "integration", "vllm", "patches.py")):
        raise RuntimeError(f"KVCACHED_SRC={src!r} holds no unpacked kvcached source")
    return src


def install_stubs() -> types.ModuleType:
    """Put kvcached on ``sys.path``, fake its allocator; return the real ``interfaces``."""
    src = source_dir()
    if src not in sys.path:
        sys.path.insert(0, src)
    os.environ["ENABLE_KVCACHED"] = "1"
    os.environ["KVCACHED_AUTOPATCH"] = "1"
    os.environ.setdefault("KVCACHED_MAX_CACHED_TOKENS", MAX_CACHED_TOKENS)
    sys.modules.setdefault("kvcached.vmm_ops", _fake_vmm_ops())
    with warnings.catch_warnings():
        # kvcached warns that kvcached_autopatch.pth is not installed: expected here.
        warnings.simplefilter("ignore", RuntimeWarning)
        import kvcached  # noqa: F401
    interfaces = importlib.import_module("kvcached.integration.vllm.interfaces")
    import kvcached.vmm_ops as vmm_ops

    assert "CPU stand-in" in (vmm_ops.__doc__ or ""), "the real kvcached.vmm_ops was imported"

    def get_kv_cache_manager(
        num_blocks: int, block_size: int, cell_size: int, num_layers: int, **kwargs: Any
    ) -> FakePhysicalAllocator:
        allocator = FakePhysicalAllocator(num_blocks, block_size, cell_size, num_layers, **kwargs)
        ALLOCATORS.append(allocator)
        return allocator

    def init_kvcached(
        tp_rank: int = 0,
        world_size: int = 1,
        pp_rank: int = 0,
        is_worker: bool = False,
        device: str | None = None,
        async_sched: bool = False,
    ) -> None:
        interfaces._kvcached_initialized = True
        interfaces._world_size = world_size

    interfaces.get_kv_cache_manager = get_kv_cache_manager
    interfaces.init_kvcached = init_kvcached
    interfaces.get_world_size = lambda: 1
    interfaces.shutdown_kvcached = lambda: True
    return interfaces


def activate() -> dict[str, Any]:
    """Apply kvcached's vLLM autopatch in this process; return :func:`patch_state`."""
    install_stubs()
    import vllm  # noqa: F401

    importlib.import_module("kvcached.integration.vllm.autopatch")
    use_elastic_kv_cache_config()
    return patch_state()


def patch_state() -> dict[str, Any]:
    """Which of kvcached's patches are in place (its own markers)."""
    import vllm
    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_manager

    elastic = getattr(block_pool, "ElasticBlockPool", None)
    return {
        "vllm": vllm.__version__,
        "elastic_block_pool": elastic is not None,
        "elastic_mro": [c.__name__ for c in elastic.__mro__] if elastic else [],
        "native_mixin": native_mixin(elastic),
        "coordinator_init_patched": getattr(
            kv_cache_coordinator.KVCacheCoordinator.__init__, "init", False
        )
        is True,
        "allocate_slots_patched": getattr(
            kv_cache_manager.KVCacheManager.allocate_slots, "allocate_slots", False
        )
        is True,
        "max_cached_tokens": os.environ.get("KVCACHED_MAX_CACHED_TOKENS"),
    }


def native_mixin(cls: type | None) -> bool:
    return cls is not None and any(c.__name__ == "NativeBlockPoolMixin" for c in cls.__mro__)


def legacy_pool_class() -> type:
    """kvcached's legacy ``ElasticBlockPool`` (its own index, no vLLM native state), built
    by kvcached's own patch as it builds it for vLLM < 0.26 or >= 0.31: the variant the
    guard must refuse, forced here on a vLLM where kvcached would build the other one."""
    from kvcached.integration.vllm.patches import ElasticBlockPoolPatch
    from vllm.v1.core import block_pool

    namespace = types.ModuleType("legacy_variant_target")
    namespace.BlockPool = block_pool.BlockPool  # type: ignore[attr-defined]
    namespace.KVCacheBlock = block_pool.KVCacheBlock  # type: ignore[attr-defined]
    patch = ElasticBlockPoolPatch()
    patch.detected_version = "0.25.0"  # outside kvcached's native-index window
    assert patch.inject_elastic_block_pool(namespace)
    legacy: type = namespace.ElasticBlockPool  # type: ignore[attr-defined]
    assert not native_mixin(legacy)
    return legacy


# -- the scheduler factory's KV config, with the backing kvcached requires ---------------

_ORIGINAL_KV_CACHE_CONFIG: Any = None


def elastic_kv_cache_config(spec: Any, *args: Any, **kwargs: Any) -> Any:
    """The factory's single-group KV config plus one backing tensor.

    kvcached's MRV2 geometry check (``model_runner_v2.cache_geometry``, used by its
    coordinator patch on vLLM 0.29-0.30) requires one backing and positive block counts;
    the factory's config has none. The factory's spec (1 head, head size 1, fp32) gives
    128-byte pages at block size 16, which tile kvcached's 2 MiB page.
    """
    from vllm.v1.kv_cache_interface import KVCacheTensor

    config = _ORIGINAL_KV_CACHE_CONFIG(spec, *args, **kwargs)
    group = config.kv_cache_groups[0]
    page = group.kv_cache_spec.page_size_bytes
    config.kv_cache_tensors = [
        KVCacheTensor(
            size=page * spec.num_blocks,
            layers=list(group.layer_names),
            layer_stride=page,
            block_stride=page,
        )
    ]
    return config


def use_elastic_kv_cache_config() -> None:
    """Make ``factory.make_scheduler`` build KV configs kvcached accepts."""
    global _ORIGINAL_KV_CACHE_CONFIG
    from vllm_prefix_guard_harness import factory

    if factory.kv_cache_config is not elastic_kv_cache_config:
        _ORIGINAL_KV_CACHE_CONFIG = factory.kv_cache_config
        factory.kv_cache_config = elastic_kv_cache_config
