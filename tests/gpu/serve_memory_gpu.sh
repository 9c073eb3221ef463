#!/usr/bin/env bash
# The KV cache sized by device memory (kv_blocks 0, kv_memory_fraction;
# configs/README.md), with tq6 and an NVFP4 cache on one GPU:
#  - the server logs the blocks kv_memory_fraction 0.25 gave, at least one
#    per sequence slot, and its "serve:" line reports the same count; with
#    kl_sample_rate 0.0625 the monitoring shadow's BF16 blocks are logged
#    too, at least one a slot;
#  - the server's device memory (nvidia-smi) stays within 0.25 of the
#    device's total plus 3 GiB (activations, workspaces, the CUDA context,
#    which the fraction leaves out);
#  - greedy /generate answers;
#  - a fraction too small for one block per slot (0.0001) stops the server
#    at start with the figures in its message.
# Needs a GPU, nvidia-smi, curl and tq6 ($FR_TQ6_DIR or
# ../shared/models/tq6); skipped otherwise. Run it alone on the GPU: other
# processes' memory counts as in use.
# usage: tests/gpu/serve_memory_gpu.sh [BUILD_DIR]
set -euo pipefail
name=serve_memory_gpu
BUILD=${1:-${BUILD:-build}}
source "$(dirname "$0")/../integration/serve_setup.bash"
need_gpu_tq6
command -v curl >/dev/null || { echo "$name: SKIP: no curl"; exit 0; }
hport=$(free_port)
start_server m "{\"model\": \"$tq6\", \"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16,
 \"kv_memory_fraction\": 0.25, \"kl_sample_rate\": 0.0625, \"metrics_port\": $hport, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
logged=$(sed -n 's/.*kv_memory_fraction 0.25: \([0-9]*\) KV blocks.*/\1/p' "$dir/m.log" | head -1)
served=$(sed -n 's/.*serve: model .* kv_blocks \([0-9]*\) .*/\1/p' "$dir/m.log" | head -1)
[ -n "$logged" ] || fail "no kv_memory_fraction line in the log: $(cat "$dir/m.log")"
[ "$logged" -ge 16 ] || fail "$logged blocks for 16 sequence slots"
[ "$logged" = "$served" ] || fail "the sizing gave $logged blocks, the serve line says $served"
shadow=$(sed -n "s/.*a monitoring shadow's \([0-9]*\) BF16 blocks.*/\1/p" "$dir/m.log" | head -1)
[ -n "$shadow" ] && [ "$shadow" -ge 16 ] || fail "the shadow's blocks: '$shadow'"
total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
used=$(device_mib "${pids[0]}")
limit=$(( total / 4 + 3072 ))
echo "$name: $logged KV blocks, the shadow's $shadow; server device memory $used MiB of $total MiB (limit $limit)"
[ "$used" -le "$limit" ] || fail "the server holds $used MiB, above 0.25 x $total + 3072"
body='{"input_ids": [256, 100, 101, 102, 103, 104], "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
code=$(curl -s -o "$dir/r.json" -w '%{http_code}' "http://127.0.0.1:$hport/generate" -d "$body")
[ "$code" = 200 ] || fail "generate: $code $(cat "$dir/r.json")"
port=$(free_port)
echo "{\"model\": \"$tq6\", \"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16,
 \"kv_memory_fraction\": 0.0001, \"metrics_port\": 0, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": $port}}" \
  > "$dir/small.json"
if timeout 120 "$bin" serve --config "$dir/small.json" 2> "$dir/small.log"; then
  fail "a server with kv_memory_fraction 0.0001 started"
fi
grep -q "fewer than the 16 sequence slots" "$dir/small.log" || fail "no reason given: $(cat "$dir/small.log")"
echo "$name: ok"
