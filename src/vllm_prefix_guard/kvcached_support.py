"""What the guard knows about kvcached, for messages and ``doctor``: never for decisions.

kvcached swaps vLLM's pool for its ``ElasticBlockPool`` after vLLM's coordinator is built;
the guard grafts onto whatever pool is assigned, and the capability checks decide whether it
can. kvcached 0.1.6 builds, on vLLM 0.26-0.30, a variant on vLLM's own index
(``NativeBlockPoolMixin``: every registration goes through ``_insert_block_hash``), which the
guard supports; its legacy variant keeps an index of its own, which the guard refuses at
start-up. Nothing here imports kvcached or triggers its patches: it reads what is already there."""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from functools import cached_property
from importlib import metadata

from vllm_prefix_guard import targets

#: kvcached's own statement of where it builds the variant the guard supports.
NATIVE_VARIANT_VLLM = "0.26-0.30 (kvcached 0.1.6)"
#: kvcached 0.1.6's engine start-up check: from this vLLM on, only the releases its
#: Model Runner V2 adapters cover (``VLLM_MRV2_RANGE`` in its ``integration.vllm.patches``) start.
GATED_FROM_VLLM = "0.29.0"
#: The index vLLM's ``BlockPool`` constructor sets up; kvcached's legacy pool never runs it.
NATIVE_INDEX = ("cached_block_hash_to_block", "cached_block_hashes_by_block")


def is_kvcached(klass: type) -> bool:
    return klass.__module__.split(".")[0] == "kvcached"


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


@dataclass(frozen=True)
class KvcachedStatus:
    installed: bool
    version: str | None
    enabled: bool
    # The ElasticBlockPool class kvcached published in this process, if it patched vLLM.
    pool_class: type | None
    vllm_version: str = "unknown"
    # kvcached's stated engine window (``>=0.29.0,<0.31.0`` in 0.1.6), once it patched vLLM.
    window: str | None = None

    @cached_property
    def variant(self) -> str | None:
        """``native-index`` where kvcached's own constructors set up vLLM's index. Only their
        stores count: vLLM's ``BlockPool.__init__`` is in every variant's MRO, never called
        by kvcached. Cached, since it parses their source."""
        if self.pool_class is None:
            return None
        stores: set[str] = set()
        for klass in filter(is_kvcached, self.pool_class.__mro__):
            stores |= targets.constructor_stores(klass)
        return "native-index" if stores.issuperset(NATIVE_INDEX) else "legacy"

    @property
    def refuses_vllm(self) -> bool | None:
        """Whether kvcached's engine start-up check refuses this vLLM; None: unknown. A
        window means kvcached's patches ran, which import ``packaging``."""
        if self.window is None:
            return None
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version

        try:
            version = Version(self.vllm_version)
            return version >= Version(GATED_FROM_VLLM) and version not in SpecifierSet(
                self.window, prereleases=True
            )
        except (InvalidVersion, InvalidSpecifier):
            return None

    @property
    def active(self) -> bool:
        """kvcached's pool is the one an engine started from this shell builds."""
        return self.enabled and self.pool_class is not None and not self.refuses_vllm

    def describe(self) -> str:
        """One line: is kvcached there, which pool the guard grafts onto, and if kvcached
        is inactive, why."""
        onto = "the guard grafts onto vLLM's BlockPool"
        if not self.installed:
            return f"not installed; {onto}"
        found = f"kvcached {self.version or '(version unknown)'} present"
        if self.active and self.pool_class is not None:
            if self.variant == "legacy":
                return (
                    f"{found}, active with its legacy ElasticBlockPool, which the guard refuses "
                    f"at start-up. {refusal_hint(self.pool_class)}"
                )
            return (
                f"{found}, active: the guard grafts onto kvcached's ElasticBlockPool "
                "(native-index variant: registrations go through vLLM's _insert_block_hash)"
            )
        refusal = (
            f"kvcached refuses vLLM {self.vllm_version} (from vLLM {GATED_FROM_VLLM} on, its "
            f"engine start-up check admits only {self.window})"
        )
        if not self.enabled:
            why = "ENABLE_KVCACHED is not set" + (f", and {refusal}" if self.refuses_vllm else "")
        elif self.pool_class is None:
            why = (
                "ENABLE_KVCACHED is set but kvcached did not patch vLLM when it was imported "
                "(kvcached_autopatch.pth did not run, or KVCACHED_AUTOPATCH is off)"
            )
        else:
            refused = ", which the guard refuses" if self.variant == "legacy" else ""
            return (
                f"{found}, inactive: {refusal}: a server started with ENABLE_KVCACHED set stops "
                f"in that check, before the guard loads; without it {onto} (kvcached's pool on "
                f"this vLLM would be its {self.variant} ElasticBlockPool{refused})"
            )
        return f"{found}, inactive: {why}; {onto}"


def status() -> KvcachedStatus:
    installed = importlib.util.find_spec("kvcached") is not None
    try:
        version = metadata.version("kvcached") if installed else None
    except metadata.PackageNotFoundError:
        version = getattr(sys.modules.get("kvcached"), "__version__", None)
    enabled = os.environ.get("ENABLE_KVCACHED", "").strip().lower() in ("1", "true")
    pool_class = getattr(sys.modules.get("vllm.v1.core.block_pool"), "ElasticBlockPool", None)
    vllm_version = str(getattr(sys.modules.get("vllm"), "__version__", "unknown"))
    window = getattr(sys.modules.get("kvcached.integration.vllm.patches"), "VLLM_MRV2_RANGE", None)
    window = window if isinstance(window, str) else None
    return KvcachedStatus(installed, version, enabled, pool_class, vllm_version, window)
