#!/usr/bin/env bash
# Weights over NCCL into a tensor-parallel server (docs/protocol.md,
# "Weights over NCCL"; docs/tensor_parallel.md, "Weight sync into several
# ranks"): `fp4rollout serve` with tq6 at tp 2 under mpirun (CUDA backend,
# NVFP4 cache) on GPUs 1 and 2, a PyTorch trainer on GPU 0
# (weight_sync_nccl.py, the checks of the tp 1 test):
#  - the group holds the trainer and both ranks (3 members); the perturbed
#    tq6 pushed as version 2 (bf16 matrices, f32 norms, 1 MiB buckets, so
#    pieces cut rows of the column-split tensors) gives greedy outputs equal
#    to a second tp 2 server's started from the perturbed checkpoint on disk;
#  - a wrong checksum and a NaN are refused and version 2 keeps serving;
#  - a trainer that dies after announcing a bucket leaves version 2 serving
#    on both ranks (greedy outputs unchanged: both ranks' shards take part
#    in every token); a new trainer then commits;
#  - the server logs every commit as switched on all 2 ranks, and each rank
#    kept only its shard (a shard stage: no whole-model stage is made).
# Needs 3 GPUs, mpirun, tq6 ($FR_TQ6_DIR or ../shared/models/tq6), PyTorch
# with CUDA for $PYTHON (default python3) and numpy; skipped otherwise.
# usage: tests/gpu/weight_sync_nccl_tp.sh [BUILD_DIR]
set -euo pipefail
name=weight_sync_nccl_tp
BUILD=${1:-${BUILD:-build}}
source "$(dirname "$0")/../integration/serve_setup.bash"
if ! command -v mpirun >/dev/null 2>&1; then echo "$name: SKIP: mpirun not found"; exit 0; fi
need_gpus=3 need_why="the trainer and two ranks"
source "$(dirname "$0")/weight_sync_setup.bash"
base="\"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"tp\": 2, \"max_seqs\": 16, \"kv_blocks\": 256, \"nccl_timeout_s\": 5, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}"
export NCCL_NVLS_ENABLE=0
mpi=(mpirun --oversubscribe -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -x CUDA_VISIBLE_DEVICES -np 2)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
# rank r uses its device r: GPUs 1 and 2; GPU 0 (the trainer's) stays visible for peer access
export CUDA_VISIBLE_DEVICES=1,2,0
start_server main "{\"model\": \"$tq6\", $base}" "${mpi[@]}"; main_ep=$ep
start_server fresh "{\"model\": \"$dir/perturbed\", $base}" "${mpi[@]}"; fresh_ep=$ep
export CUDA_VISIBLE_DEVICES=0,1,2
timeout 600 $tpy "$here/weight_sync_nccl.py" check "$main_ep" "$fresh_ep" "$dir/perturbed" 3 || fail "checks failed"
grep -q "joining as rank 1 of 3 (every rank of every engine joins)" "$dir/main.log" ||
  fail "the server did not make a group of the trainer and both ranks"
n=$(grep -c "weights are now version [0-9]* on all 2 ranks, over NCCL" "$dir/main.log" || true)
[ "$n" -eq 2 ] || fail "expected 2 commits over NCCL on all 2 ranks in the log, found $n"
echo "PASS: both commits over NCCL switched on all 2 ranks"
grep -Eq "NCCL weight group of client .* ended: (rank 1: )?NCCL weight group: (no bucket arrived|a receive in flight|ncclCommGetAsyncError|bucket [0-9]+'s broadcast did not start)" \
  "$dir/main.log" || fail "the server did not log the dead trainer's group ending"
echo "PASS: the server logged the dead trainer's group ending"
echo "$name: all checks passed"
