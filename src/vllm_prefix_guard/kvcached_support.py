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

#: kvcached's own statement of where it builds the variant the guard supports.
NATIVE_VARIANT_VLLM = "0.26-0.30 (kvcached 0.1.6)"


def is_kvcached_class(cls: type) -> bool:
    return any(klass.__module__.split(".")[0] == "kvcached" for klass in cls.__mro__)


def refusal_hint(pool_class: type) -> str:
    """The extra words of a graft refusal when the pool is kvcached's."""
    if not is_kvcached_class(pool_class):
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

    def describe(self) -> str:
        if not self.installed:
            return "not installed: the guard grafts onto vLLM's BlockPool"
        found = f"kvcached {self.version or '(version unknown)'} installed"
        if not self.enabled:
            return f"{found}, inactive (ENABLE_KVCACHED is not set): the guard uses vLLM's pool"
        if self.pool_class is None:
            return (
                f"{found}, ENABLE_KVCACHED set; kvcached has not patched vLLM in this process, "
                "so its pool variant is decided at server start"
            )
        from vllm_prefix_guard.pool import missing_pool_internals

        missing = missing_pool_internals(self.pool_class)
        if missing:
            return f"{found}, active with its legacy pool: {refusal_hint(self.pool_class)}"
        return f"{found}, active with its native-index pool: the guard grafts onto it"


def status(environ: dict[str, str] | None = None) -> KvcachedStatus:
    env = os.environ if environ is None else environ
    installed = importlib.util.find_spec("kvcached") is not None
    version = None
    if installed:
        try:
            version = metadata.version("kvcached")
        except metadata.PackageNotFoundError:
            version = getattr(sys.modules.get("kvcached"), "__version__", None)
    enabled = env.get("ENABLE_KVCACHED", "").strip().lower() in ("1", "true")
    block_pool = sys.modules.get("vllm.v1.core.block_pool")
    pool_class = getattr(block_pool, "ElasticBlockPool", None) if block_pool else None
    return KvcachedStatus(installed, version, enabled, pool_class)
