#!/usr/bin/env bash
# The cost of deterministic mode on the GPU (docs/determinism.md), in one run:
# the three GEMM modes at Qwen3-4B's decode shapes (bench/gemm_modes), then
# decode steps of synthetic Qwen3-4B-shaped weights at batch 1, 16 and 64,
# 4K and 32K tokens per sequence, BF16 and NVFP4 caches, each batch timed in
# the default mode and in deterministic mode side by side on the same caches
# (bench/decode_step --vs-deterministic; contexts filled without attention).
# BF16 at 32K stops at batch 16: 64 sequences of 32K BF16 tokens are 309 GB.
#
# usage: bench/determinism_cost.sh [--build DIR] [--steps N]
set -euo pipefail
build=build steps=10
while [ $# -gt 0 ]; do
  case $1 in
    --build) build=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "determinism_cost: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
for b in gemm_modes decode_step; do
  [ -x "$build/bench/$b" ] || { echo "determinism_cost: $build/bench/$b is missing (make bench)" >&2; exit 1; }
done
echo "## GEMM modes"
"$build/bench/gemm_modes" --markdown
for kv in bf16 nvfp4; do
  for ctx in 4096 32768; do
    batches=1,16,64
    [ "$kv" = bf16 ] && [ "$ctx" = 32768 ] && batches=1,16
    echo
    echo "## $kv KV, $ctx tokens per sequence"
    "$build/bench/decode_step" --kv "$kv" --context "$ctx" --batches "$batches" --fill --steps "$steps" \
      --vs-deterministic --markdown 2> >(grep -v INFO >&2)
  done
done
