"""How the project installs vLLM and runs it for its tests, fuzz runs and release checks:
data the noxfile, ``compat/``, the vLLM-suite runner and the benchmarks share. Not part of
the wheel (operators run vLLM their own way)."""

from __future__ import annotations

#: Removed right after a vLLM is installed: the package index's builds of these break
#: ``import vllm`` next to the CPU torch wheel.
BREAKS_VLLM_IMPORT = ("torchvision", "torchaudio", "torchcodec")

#: The environment the project runs vLLM in: offline, a 1 GiB CPU KV cache, quiet
#: tokenizers, and a fixed hash seed (vLLM's scheduling order follows it; fuzz runs must
#: replay exactly).
TEST_ENV: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONHASHSEED": "0",
}
