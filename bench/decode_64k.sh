#!/usr/bin/env bash
# Decode throughput at 64K context per sequence, every KV dtype, concurrency
# from 1 up to what the KV memory holds for each (the end-to-end throughput
# of the distributed-workers issue): bench/decode_step on synthetic
# Qwen3-4B-shaped weights with a 128K window, contexts filled without
# attention (--fill), one markdown table per dtype, then the peak tokens/s of
# each dtype against BF16's.
#
# usage: bench/decode_64k.sh [--shape S] [--kv-gb G] [--context N] [--steps N] [--kvs LIST]
#                            [--fp4-compute MODE] [--build DIR]
#   --shape S     qwen3-4b (default; 36 layers x 8 KV heads), qwen3-30b-a3b
#                 (the Mixture-of-Experts shape; 48 layers x 4 KV heads) or
#                 deepseek-v2-lite (latent attention, 27 layers of one latent
#                 row a token; its window is 32K, so --context defaults to
#                 32,512 for it)
#   --kv-gb G     device memory for the KV cache in GB (default: an H200 less
#                 the weights and the engine's buffers: 115 for qwen3-4b's
#                 8 GB, 70 for qwen3-30b-a3b's 61 GB, 95 for
#                 deepseek-v2-lite's 31 GB)
#   --context N   tokens per sequence (default 65536; 32,512 for deepseek-v2-lite)
#   --steps N     timed decode steps per batch (default 10)
#   --kvs LIST    dtypes (default bf16,fp8,nvfp4,mxfp4)
#   --fp4-compute MODE  bf16 (query and P in BF16: the CUDA engine's default) or
#                 exact (the recipe's FP4 query and P) for the FP4 caches
# Capacity per dtype: G / (context x layers x KV heads x the dtype's
# bytes per token and head: 512 BF16, 256 FP8, 144 NVFP4, 136 MXFP4; a
# latent row of deepseek-v2-lite: 1,152 BF16, 640 FP8, 416 NVFP4, 400
# MXFP4, docs/formats.md), less one sequence (decode_step's cache holds one
# spare); batches are the powers of two below it, and it.
set -euo pipefail
kv_gb= context= steps=10 kvs=bf16,fp8,nvfp4,mxfp4 build=build compute=bf16 shape=qwen3-4b
while [ $# -gt 0 ]; do
  case $1 in
    --shape) shape=$2; shift 2 ;;
    --kv-gb) kv_gb=$2; shift 2 ;;
    --context) context=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --kvs) kvs=$2; shift 2 ;;
    --fp4-compute) compute=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    -h | --help) awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit 0 ;;
    *) echo "decode_64k: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
declare -A per_token=([bf16]=512 [fp8]=256 [nvfp4]=144 [mxfp4]=136)
case $shape in
  qwen3-4b) layer_heads=$((36 * 8)) default_gb=115 model=synthetic:qwen3-4b-128k default_ctx=65536 ;;
  qwen3-30b-a3b) layer_heads=$((48 * 4)) default_gb=70 model=synthetic:qwen3-30b-a3b-128k default_ctx=65536 ;;
  deepseek-v2-lite) layer_heads=27 default_gb=95 model=synthetic:deepseek-v2-lite default_ctx=32512
    per_token=([bf16]=1152 [fp8]=640 [nvfp4]=416 [mxfp4]=400) ;;
  *) echo "decode_64k: unknown shape $shape (qwen3-4b, qwen3-30b-a3b or deepseek-v2-lite)" >&2; exit 2 ;;
esac
kv_gb=${kv_gb:-$default_gb}
context=${context:-$default_ctx}
bin=$build/bench/decode_step
[ -x "$bin" ] || { echo "decode_64k: $bin is missing (make bench)" >&2; exit 1; }
declare -A peak
IFS=, read -r -a list <<< "$kvs"
for kv in "${list[@]}"; do
  [ -n "${per_token[$kv]:-}" ] || { echo "decode_64k: unknown dtype $kv" >&2; exit 2; }
  cap=$(awk -v g="$kv_gb" -v c="$context" -v b="${per_token[$kv]}" -v lh="$layer_heads" \
        'BEGIN { n = int(g * 1e9 / (c * lh * b)) - 1; print (n < 1 ? 1 : n) }')
  batches=1
  for ((b = 2; b < cap; b *= 2)); do batches="$batches,$b"; done
  [ "$cap" -gt 1 ] && batches="$batches,$cap"
  echo "decode_64k: $kv, up to $cap sequences of $context tokens (batches $batches)" >&2
  out=$("$bin" --model "$model" --kv "$kv" --context "$context" --fill --batches "$batches" \
        --steps "$steps" --fp4-compute "$compute" --markdown)
  echo "$out"
  echo
  # the largest tokens/s of the table (its fourth column)
  peak[$kv]=$(echo "$out" | awk -F'|' 'NF > 8 && $2 ~ /^ *[0-9]+ *$/ { if ($5 + 0 > m) m = $5 + 0 } END { print m + 0 }')
done
echo "| kv | peak tokens/s | vs bf16 |"
echo "|---|---|---|"
for kv in "${list[@]}"; do
  ratio=$( [ -n "${peak[bf16]:-}" ] && awk -v a="${peak[$kv]}" -v b="${peak[bf16]}" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }' || echo "-")
  echo "| $kv | ${peak[$kv]} | $ratio |"
done
