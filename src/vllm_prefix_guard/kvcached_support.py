"""What the guard knows about kvcached, for messages and ``doctor``: never for decisions.

kvcached (elastic GPU memory for vLLM) swaps vLLM's pool for its ``ElasticBlockPool``
after vLLM's coordinator is built. The guard grafts onto whatever pool is assigned, and
the capability checks decide whether it can: kvcached 0.1.6 builds, on vLLM 0.26-0.30, a
variant on vLLM's own index (``NativeBlockPoolMixin``: every registration goes through
``_insert_block_hash``), which the guard supports; elsewhere its legacy variant keeps an
index of its own, which the guard refuses at start-up. Nothing here imports kvcached or
triggers its patches: it reads what is already there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from importlib import metadata

from vllm_prefix_guard import targets

#: kvcached's own statement of where it builds the variant the guard supports.
NATIVE_VARIANT_VLLM = "0.26-0.30 (kvcached 0.1.6)"
#: kvcached 0.1.6's engine start-up check: from this vLLM on, only the releases its
#: Model Runner V2 adapters cover (``VLLM_MRV2_RANGE`` in the module below) start.
GATED_FROM_VLLM = "0.29.0"
PATCHES_MODULE = "kvcached.integration.vllm.patches"
#: The index vLLM's ``BlockPool`` constructor sets up; kvcached's legacy pool never runs it.
NATIVE_INDEX = ("cached_block_hash_to_block", "cached_block_hashes_by_block")
VLLM_POOL = "vLLM's BlockPool"


def is_kvcached(klass: type) -> bool:
    return klass.__module__.split(".")[0] == "kvcached"


def builds_native_index(pool_class: type) -> bool:
    """Whether kvcached's own constructors set up vLLM's index (its native-index
    variant). vLLM's ``BlockPool.__init__`` is in every variant's MRO but kvcached never
    calls it, so only the stores of kvcached's classes count."""
    stores: set[str] = set()
    for klass in filter(is_kvcached, pool_class.__mro__):
        stores |= targets.constructor_stores(klass)
    return all(name in stores for name in NATIVE_INDEX)


def refusal_hint(pool_class: type) -> str:
    """The extra words of a graft refusal when the pool is kvcached's."""
    if not any(map(is_kvcached, pool_class.__mro__)):
        return ""
    return (
        "This is kvcached's ElasticBlockPool in its legacy variant (an index of its own, "
        "registrations outside vLLM's _insert_block_hash), which the guard cannot track. "
        f"kvcached builds the variant the guard supports on vLLM {NATIVE_VARIANT_VLLM}. "
        "Run kvcached on one of those, or disable kvcached (ENABLE_KVCACHED=0)."
    )


def engine_window() -> str | None:
    """The vLLM releases kvcached lets an engine start on, as kvcached states them
    (``>=0.29.0,<0.31.0`` in 0.1.6); None until kvcached has patched this process."""
    window = getattr(sys.modules.get(PATCHES_MODULE), "VLLM_MRV2_RANGE", None)
    return window if isinstance(window, str) else None


@dataclass(frozen=True)
class KvcachedStatus:
    installed: bool
    version: str | None
    enabled: bool
    # The ElasticBlockPool class kvcached published in this process, if it patched vLLM.
    pool_class: type | None
    vllm_version: str = "unknown"
    # kvcached's stated engine window, once it patched this process.
    window: str | None = None

    @property
    def variant(self) -> str | None:
        if self.pool_class is None:
            return None
        return "native-index" if builds_native_index(self.pool_class) else "legacy"

    @property
    def refuses_vllm(self) -> bool | None:
        """Whether kvcached's engine start-up check refuses this vLLM; None: unknown."""
        if self.window is None:
            return None
        try:
            from packaging.specifiers import InvalidSpecifier, SpecifierSet
            from packaging.version import InvalidVersion, Version
        except ImportError:  # pragma: no cover - vLLM depends on packaging
            return None
        try:
            version = Version(self.vllm_version)
            if version < Version(GATED_FROM_VLLM):
                return False
            return version not in SpecifierSet(self.window, prereleases=True)
        except (InvalidVersion, InvalidSpecifier):
            return None

    @property
    def active(self) -> bool:
        """kvcached's pool is the one an engine started from this shell builds."""
        return self.enabled and self.pool_class is not None and not self.refuses_vllm

    def describe(self) -> str:
        """One line: is kvcached there, which pool the guard grafts onto, and if kvcached
        is inactive, why."""
        if not self.installed:
            return f"not installed; the guard grafts onto {VLLM_POOL}"
        found = f"kvcached {self.version or '(version unknown)'} present"
        refusal = (
            f"kvcached refuses vLLM {self.vllm_version} (from vLLM {GATED_FROM_VLLM} on, its "
            f"engine start-up check admits only {self.window})"
            if self.refuses_vllm
            else None
        )
        if not self.enabled:
            why = "ENABLE_KVCACHED is not set" + (f", and {refusal}" if refusal else "")
            return f"{found}, inactive: {why}; the guard grafts onto {VLLM_POOL}"
        if self.pool_class is None:
            return (
                f"{found}, inactive: ENABLE_KVCACHED is set but kvcached did not patch vLLM "
                "when it was imported (kvcached_autopatch.pth did not run, or "
                f"KVCACHED_AUTOPATCH is off); the guard grafts onto {VLLM_POOL}"
            )
        if refusal:
            return (
                f"{found}, inactive: {refusal}: a server started with ENABLE_KVCACHED set "
                "stops in that check, before the guard loads; without it the guard grafts "
                f"onto {VLLM_POOL} (kvcached's pool on this vLLM would be its {self.variant} "
                "ElasticBlockPool"
                + (", which the guard refuses)" if self.variant == "legacy" else ")")
            )
        if self.variant == "legacy":
            return (
                f"{found}, active with its legacy ElasticBlockPool, which the guard refuses "
                f"at start-up. {refusal_hint(self.pool_class)}"
            )
        return (
            f"{found}, active: the guard grafts onto kvcached's ElasticBlockPool "
            "(native-index variant: registrations go through vLLM's _insert_block_hash)"
        )


def status() -> KvcachedStatus:
    installed = importlib.util.find_spec("kvcached") is not None
    version = None
    if installed:
        try:
            version = metadata.version("kvcached")
        except metadata.PackageNotFoundError:
            version = getattr(sys.modules.get("kvcached"), "__version__", None)
    enabled = os.environ.get("ENABLE_KVCACHED", "").strip().lower() in ("1", "true")
    block_pool = sys.modules.get("vllm.v1.core.block_pool")
    pool_class = getattr(block_pool, "ElasticBlockPool", None) if block_pool else None
    vllm = sys.modules.get("vllm")
    vllm_version = str(getattr(vllm, "__version__", "unknown")) if vllm else "unknown"
    return KvcachedStatus(installed, version, enabled, pool_class, vllm_version, engine_window())
