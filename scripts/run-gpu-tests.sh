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
pass=0 fail=0
for t in "${tests[@]}"; do
    case $t in *.d) continue ;; esac
    echo "=== $t"
    start=$(date +%s)
    launch=()
    case $(basename "$t") in test_nccl*)
        if command -v mpirun >/dev/null 2>&1 && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
            launch=(mpirun --oversubscribe -np 2)
            [ "$(id -u)" -eq 0 ] && launch+=(--allow-run-as-root)
        fi ;;
    esac
    timeout "$limit" ${launch[@]+"${launch[@]}"} "$t"
    rc=$?
    echo "=== $t: exit $rc, $(( $(date +%s) - start )) s"
    if [ $rc -eq 0 ]; then pass=$((pass + 1)); else fail=$((fail + 1)); fi
done
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
