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
here=$(cd "$(dirname "$0")" && pwd)
tpy=${PYTHON:-python3}
tq6=$(cd "${FR_TQ6_DIR:-../shared/models/tq6}" 2>/dev/null && pwd || true)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${ngpu:-0}" -lt 2 ]; then echo "$name: SKIP: needs 2 GPUs"; exit 0; fi
if [ -z "$tq6" ] || [ ! -f "$tq6/config.json" ]; then echo "$name: SKIP: tq6 not found"; exit 0; fi
$tpy -c 'import torch, numpy; assert torch.cuda.is_available()' 2>/dev/null ||
  { echo "$name: SKIP: $tpy has no PyTorch with CUDA (or no numpy)"; exit 0; }
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
export FP4ROLLOUT_CLIENT_LIB=$(cd "$build" && pwd)/libfp4rollout_client.so

$tpy "$here/../integration/serve_tq6_update.py" "$tq6" "$dir/perturbed" > "$dir/perturb.log" 2>&1 ||
  fail "perturbing tq6 failed"
base="\"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16, \"kv_blocks\": 256, \"nccl_timeout_s\": 5, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}"
# NCCL refuses a group whose members run different NCCL versions: the
# servers load the libnccl PyTorch loads.
nccl_dir=$($tpy -c 'import os, torch; torch.cuda.init()
print(next((os.path.dirname(l.split()[-1]) for l in open("/proc/self/maps") if "libnccl.so" in l), ""))')
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "$name: NCCL for the servers from ${nccl_dir:-the system}"
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
