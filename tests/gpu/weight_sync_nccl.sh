#!/usr/bin/env bash
# Weights over NCCL on two GPUs (docs/protocol.md, "Weights over NCCL"):
# `fp4rollout serve` with tq6 on the CUDA backend (NVFP4 cache) on GPU 1,
# a PyTorch trainer on GPU 0 (weight_sync_nccl.py):
#  - the trainer pushes a perturbed tq6 (bf16 matrices, f32 norms, 1 MiB
#    buckets) over its NCCL group as version 2; afterwards greedy outputs
#    equal a second server's, started from the perturbed checkpoint on disk;
#  - a wrong checksum and a NaN are refused (bad_checksum, non_finite) and
#    version 2 keeps serving;
#  - a trainer that dies after announcing a bucket, before broadcasting it,
#    leaves the server on version 2, serving, its update dropped (after
#    nccl_timeout_s, 5 s here, unless NCCL reports the dead peer sooner); a
#    new trainer then makes a group and commits.
# Needs 2 GPUs, tq6 ($FR_TQ6_DIR or ../shared/models/tq6), PyTorch with CUDA
# for $PYTHON (default python3) and numpy; skipped with a message otherwise.
# usage: tests/gpu/weight_sync_nccl.sh [BUILD_DIR]
set -euo pipefail
name=weight_sync_nccl
BUILD=${1:-${BUILD:-build}}
source "$(dirname "$0")/../integration/serve_setup.bash"
need_gpus=2 need_why="the trainer and the server"
source "$(dirname "$0")/weight_sync_setup.bash"
base="\"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16, \"kv_blocks\": 256, \"nccl_timeout_s\": 5, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}"
export CUDA_VISIBLE_DEVICES=1,0   # the server uses its device 0 (GPU 1); GPU 0 stays visible for peer access
start_server main "{\"model\": \"$tq6\", $base}"; main_ep=$ep
start_server fresh "{\"model\": \"$dir/perturbed\", $base}"; fresh_ep=$ep
export CUDA_VISIBLE_DEVICES=0,1
timeout 300 $tpy "$here/weight_sync_nccl.py" check "$main_ep" "$fresh_ep" "$dir/perturbed" || fail "checks failed"
# NCCL may notice the dead peer itself, else the timeout ends the group
grep -Eq "NCCL weight group of client .* ended: NCCL weight group: (no bucket arrived|a receive in flight|ncclCommGetAsyncError|bucket [0-9]+'s broadcast did not start)" \
  "$dir/main.log" || fail "the server did not log the dead trainer's group ending"
echo "PASS: the server logged the dead trainer's group ending ($(grep -Eo "ended: NCCL weight group: [a-z ]+" "$dir/main.log" | tail -1))"
echo "$name: all checks passed"
