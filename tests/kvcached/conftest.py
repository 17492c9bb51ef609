"""kvcached 0.1.6's real vLLM integration with the guard, on CPU (only its allocator faked).

The whole directory is skipped, with the reason, unless:

- ``$KVCACHED_SRC`` holds kvcached's unpacked source (``python scripts/fetch_kvcached.py
  .nox/kvcached-0.1.6``; the sdist cannot be built without CUDA, see ``kvcached_cpu``);
- kvcached's own dependencies ``wrapt`` and ``posix_ipc`` are importable;
- the installed vLLM is one these tests are written for: from 0.29 on, kvcached 0.1.6
  admits an engine only on the releases its Model Runner V2 adapters cover (read from its
  source: ``VLLM_MRV2_RANGE``, ``>=0.29.0,<0.31.0``). There the proofs run
  (``test_kvcached_admitted.py``); on a later vLLM kvcached refuses, and the refusals run
  (``test_kvcached_refused.py``).

kvcached patches vLLM process-wide and cannot be undone, so the scenarios run in one
subprocess per load order (``scenarios.py``), each reporting JSON the tests assert on;
this pytest process itself never imports kvcached.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from kvcached_harness import HERE, skip_reason


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = skip_reason()
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).resolve().parents:
            item.add_marker(pytest.mark.skip(reason=reason))
