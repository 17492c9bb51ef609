#!/usr/bin/env bash
# GPU check for vllm-prefix-guard (manual; CI runs on CPU and never runs this).
#
# Runs the engine-level reproduction, tests/e2e/test_engine_zombie.py, on vLLM's CUDA wheel with
# async scheduling on (two steps in flight), which vLLM's CPU backend cannot do. It asserts that
# stock prefix caching diverges from an engine without prefix caching, and that the guard,
# applied through its plugin entry point with VLLM_PREFIX_GUARD=1, matches it.
#
# Usage:    scripts/gpu_check.sh [extra pytest args]
# Env:      PYTHON             interpreter of the venv with vllm (CUDA) and this project
#                              installed (default: python)
#           GPU_CHECK_TIMEOUT  hard limit in seconds (default: 300)
# Sizing:   one GPU, about a minute on one H200: three in-process engines of a 6 MB float32
#           model, eager mode, 20 KV blocks each; under 5 minutes including imports.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
TIMEOUT="${GPU_CHECK_TIMEOUT:-300}"

"$PYTHON" scripts/gpu_check.py

# Offline: the tiny model is generated locally, nothing is downloaded.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
# Torch matmuls in full float32; vLLM's default, pinned because the tolerance relies on it.
export VLLM_FLOAT32_MATMUL_PRECISION=highest
# Async scheduling, and a modest memory share so that the three engines built one after the
# other in this process never trip vLLM's free-memory check on a leftover allocation.
export VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS='{"async_scheduling": true, "gpu_memory_utilization": 0.3}'
# float32 on Hopper runs attention in Triton, whose float32 dot products use TF32: allow 1e-2
# (corruption measured on CPU: 0.82 nat on the first token; batch-shape noise: 1.2e-5).
export VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL=1e-2
unset VLLM_PREFIX_GUARD VLLM_PLUGINS

exec timeout --kill-after=30 "$TIMEOUT" \
    "$PYTHON" -m pytest tests/e2e/test_engine_zombie.py -m e2e -p no:cacheprovider -q -rA "$@"
