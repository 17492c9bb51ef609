"""kvcached installed on a vLLM it refuses (0.31 in CI): the guard runs on vLLM's own pool.

kvcached 0.1.6 still patches vLLM 0.31 on import, but publishes its legacy
``ElasticBlockPool`` (its own index: the guard refuses it) and its ``EngineCore`` check
stops an engine with ``ENABLE_KVCACHED`` set ("no runner adapter"). So with kvcached not
enabled the guard grafts onto vLLM's ``BlockPool`` and fixes the zombie there; enabled,
the guard's refusal names kvcached, and ``doctor`` says kvcached is present, which pool
the guard grafts onto and why kvcached is inactive.
"""

from __future__ import annotations

import pytest
from kvcached_harness import kvcached_src, scenarios, vllm_admitted

_src = kvcached_src()
pytestmark = pytest.mark.skipif(
    _src is not None and vllm_admitted(_src),
    reason="kvcached admits this vLLM (see test_kvcached_admitted.py)",
)


def test_kvcached_patches_this_vllm_with_its_legacy_pool() -> None:
    patches = scenarios("vllm_pool")["patches"]
    assert patches["elastic_block_pool"] and not patches["native_mixin"]
    assert patches["elastic_mro"] == ["ElasticBlockPool", "BlockPool", "object"]


def test_not_enabled_the_guard_fixes_the_zombie_on_vllm_pool() -> None:
    disabled = scenarios("vllm_pool")["kvcached_disabled"]
    guarded, unguarded = disabled["zombie_sync"], disabled["zombie_sync_unguarded"]
    assert guarded["pool"]["pool_mro"][0] == "BlockPool" and guarded["pool"]["guarded"]
    assert unguarded["violations"] > 0 and guarded["violations"] == 0
    assert guarded["audit"]["each_recorded"]
    assert disabled["status"]["describe"].startswith(
        "kvcached 0.1.6 present, inactive: ENABLE_KVCACHED is not set, and kvcached refuses vLLM"
    )


@pytest.mark.parametrize("how", ["native", "forced"])
def test_enabled_the_guard_refuses_kvcached_legacy_pool(how: str) -> None:
    result = scenarios("vllm_pool")
    refused = result["pool"] if how == "native" else result["legacy_refused"]
    assert refused["error_type"] == "vllm_prefix_guard.errors.GuardUnsupportedError"
    assert "kvcached's ElasticBlockPool in its legacy variant" in refused["error"]
    assert "vLLM 0.26-0.30" in refused["error"]


def test_kvcached_own_check_refuses_the_engine() -> None:
    gate = scenarios("vllm_pool")["engine_gate"]["result"]
    assert gate.startswith("kvcached.utils.KVCachedConfigError: kvcached has no runner adapter")


def test_kvcached_patches_on_import_when_installed() -> None:
    patched = scenarios("vllm_pool")["patched_on_import"]
    assert patched["elastic_block_pool"] and patched["autopatch_module"]


def test_doctor_says_present_which_pool_and_why_inactive() -> None:
    """``vllm-prefix-guard doctor --json`` with kvcached installed (patched on import) and
    ``ENABLE_KVCACHED`` set: present, the guard's pool, why kvcached is inactive."""
    doctor = scenarios("vllm_pool")["doctor"]
    assert [(n, c["detail"]) for n, c in doctor["checks"].items() if not c["ok"]] == []
    assert doctor["status"] == 0
    detail = doctor["checks"]["kvcached"]["detail"]
    assert detail.startswith("kvcached 0.1.6 present, inactive: kvcached refuses vLLM")
    assert "its engine start-up check admits only >=0.29.0,<0.31.0" in detail
    assert "the guard grafts onto vLLM's BlockPool" in detail
    assert "legacy ElasticBlockPool, which the guard refuses" in detail
