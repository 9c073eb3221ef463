#!/usr/bin/env bash
# Runs the GPU tests (build/gpu/test_*, built by `make` when nvcc is present)
# on a machine with a CUDA device, each under a time limit, and ends with one
# line "N passed, N failed". With the tq6 checkpoint found ($FR_TQ6_DIR or
# ../shared/models/tq6) and PyTorch + transformers importable, it first
# records transformers' own bfloat16 figures for test_engine_gpu.
#
# test_nccl* needs two ranks: it runs under `mpirun -np 2` when mpirun is
# there and the machine has two GPUs (alone, it skips its cases).
#
# usage: scripts/run-gpu-tests.sh [BUILD_DIR] [TEST_NAME...]
set -u
build=${1:-build}
shift || true
limit=${FR_GPU_TEST_LIMIT:-600}
tq6=${FR_TQ6_DIR:-../shared/models/tq6}
if [ -z "${FR_HF_BF16_STATS:-}" ] && [ -f "$tq6/golden.safetensors" ] &&
   python3 -c 'import torch, transformers' 2>/dev/null; then
    export FR_HF_BF16_STATS=${TMPDIR:-/tmp}/fr_hf_bf16_stats.txt
    python3 tests/gpu/hf_bf16_reference.py "$tq6" "$FR_HF_BF16_STATS" ||
        { echo "transformers reference failed; test_engine_gpu prints our figures only"; unset FR_HF_BF16_STATS; }
fi
if [ $# -gt 0 ]; then tests=(); for n in "$@"; do tests+=("$build/gpu/$n"); done
else tests=("$build"/gpu/test_*); fi
# FR_GPU_TEST_JOBS=N runs N tests at once (their CPU references are the slow
# part); each test's output is then printed whole when it ends.
jobs=${FR_GPU_TEST_JOBS:-1}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_one() {   # test path, log file; the exit status goes to log.rc
    local t=$1 log=$2 start launch=()
    start=$(date +%s)
    case $(basename "$t") in test_nccl*)
        if command -v mpirun >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
            launch=(mpirun --oversubscribe -np 2)
            [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
        fi ;;
    esac
    { echo "=== $t"
      timeout "$limit" ${launch[@]+"${launch[@]}"} "$t"
      echo $? >"$log.rc"
      echo "=== $t: exit $(cat "$log.rc"), $(( $(date +%s) - start )) s"; } >"$log" 2>&1
}
names=()
for t in "${tests[@]}"; do
    case $t in *.d) continue ;; esac
    names+=("$t")
done
i=0
for t in "${names[@]}"; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n; done
    run_one "$t" "$logs/$i" &
    i=$((i + 1))
done
wait
pass=0 fail=0
for ((i = 0; i < ${#names[@]}; i++)); do
    cat "$logs/$i"
    if [ "$(cat "$logs/$i.rc" 2>/dev/null)" = 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
