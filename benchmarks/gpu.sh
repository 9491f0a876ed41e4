#!/usr/bin/env bash
# The GPU table of benchmarks/README.md: tokens/s, MFU against the datasheet bf16 peak and peak
# memory of GPT-2 124M / 350M and a Llama-style 1B at T=2048, attention_impl xla vs cudnn.
#
#   benchmarks/gpu.sh [--tiny] [OUT_DIR]     (default OUT_DIR: benchmarks/gpu-results)
#
# Each cell runs in its own process (the allocator's peak is per process; an out-of-memory ends one
# cell, not the table) under a time limit; a few minutes in all on an H100/H200. --tiny runs the
# same script with tiny models on any machine (a CPU too) to check the script; its figures mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
TINY=()
if [[ "${1:-}" == "--tiny" ]]; then TINY=(--tiny); shift; fi
OUT="${1:-benchmarks/gpu-results}"
STEPS="${STEPS:-10}"
mkdir -p "$OUT"
# the plan (preflight) and the timed step compile the same program: the second is read from this cache
export JAX_COMPILATION_CACHE_DIR="${JAX_COMPILATION_CACHE_DIR:-$OUT/xla-cache}"
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
: > "$OUT/results.jsonl"
python -c "import jax; print('devices:', jax.devices())" | tee "$OUT/devices.txt"
for model in gpt2-124m gpt2-350m llama-1b; do
  for attention in xla cudnn; do
    echo "== $model, attention $attention" >&2
    if ! timeout "${CELL_TIMEOUT:-300}" python benchmarks/gpu.py --model "$model" --attention "$attention" \
        --steps "$STEPS" "${TINY[@]}" >> "$OUT/results.jsonl"; then
      echo "{\"model\": \"$model\", \"attention\": \"$attention\", \"error\": \"the process failed or timed out (see stderr)\"}" >> "$OUT/results.jsonl"
    fi
  done
done
python benchmarks/gpu.py --table "$OUT/results.jsonl" | tee "$OUT/table.md"
