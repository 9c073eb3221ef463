# Sourced by weight_sync_nccl*.sh after ../integration/serve_setup.bash (not
# a test itself). Expects `need_gpus` (and `need_why`, what they are for);
# skips with a message unless there are that many GPUs, tq6 ($FR_TQ6_DIR or
# ../shared/models/tq6) and PyTorch with CUDA and numpy for $PYTHON (default
# python3). Defines here, tpy, tq6, the perturbed tq6 in $dir/perturbed and
# nccl_dir, and exports FP4ROLLOUT_CLIENT_LIB and, in LD_LIBRARY_PATH, the
# libnccl PyTorch loads: NCCL refuses a group whose members run different
# NCCL versions.
here=$(cd "$(dirname "$0")" && pwd)
tpy=${PYTHON:-python3}
tq6=$(cd "${FR_TQ6_DIR:-../shared/models/tq6}" 2>/dev/null && pwd || true)
ngpu=$(nvidia-smi -L 2>/dev/null | wc -l || true)
if [ "${ngpu:-0}" -lt "$need_gpus" ]; then echo "$name: SKIP: needs $need_gpus GPUs ($need_why)"; exit 0; fi
if [ -z "$tq6" ] || [ ! -f "$tq6/config.json" ]; then echo "$name: SKIP: tq6 not found"; exit 0; fi
$tpy -c 'import torch, numpy; assert torch.cuda.is_available()' 2>/dev/null ||
  { echo "$name: SKIP: $tpy has no PyTorch with CUDA (or no numpy)"; exit 0; }
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
export FP4ROLLOUT_CLIENT_LIB=$(cd "$build" && pwd)/libfp4rollout_client.so

$tpy "$here/../integration/serve_tq6_update.py" "$tq6" "$dir/perturbed" > "$dir/perturb.log" 2>&1 ||
  fail "perturbing tq6 failed"
nccl_dir=$($tpy -c 'import os, torch; torch.cuda.init()
print(next((os.path.dirname(l.split()[-1]) for l in open("/proc/self/maps") if "libnccl.so" in l), ""))')
[ -n "$nccl_dir" ] && export LD_LIBRARY_PATH="$nccl_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "$name: NCCL for the servers from ${nccl_dir:-the system}"
