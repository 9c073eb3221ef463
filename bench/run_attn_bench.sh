#!/usr/bin/env bash
# The decode-attention kernel benchmark and its PyTorch peer in one go, on a
# machine with a GPU, nvcc and PyTorch; then the markdown table.
#
# usage: bench/run_attn_bench.sh OUT_DIR [--shapes S] [--batches B] [--contexts C]
#                                [--runs N] [--warmup N] [--rotate-mb MB] [--seed N]
#                                [--kernels K] [--no-backend]
# Every option but --kernels and --no-backend goes to both programs (so their
# cases match); --kernels only to attn_decode, --no-backend (skip the profiler
# run that names SDPA's backend) only to sdpa_decode.py. Defaults: the full
# matrix (two shapes, batch 1/4/16/64, context 4K/16K/32K/128K, six kernels),
# a few minutes on an H200.
# Writes in OUT_DIR: attn_decode.csv, sdpa_decode.csv, attn_table.md and the
# two programs' logs (stderr). Environment: PYTHON (default python3),
# SKIP_BUILD=1 to use build/bench/attn_decode as it is.
set -uo pipefail

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; }

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
    usage
    [ $# -lt 1 ] && exit 2 || exit 0
fi
out=$1
shift
common=()
kernels=()
sdpa_only=()
while [ $# -gt 0 ]; do
    case "$1" in
        --shapes|--batches|--contexts|--runs|--warmup|--rotate-mb|--seed)
            [ $# -ge 2 ] || { echo "run_attn_bench: $1 needs a value" >&2; exit 2; }
            common+=("$1" "$2"); shift 2 ;;
        --kernels)
            [ $# -ge 2 ] || { echo "run_attn_bench: $1 needs a value" >&2; exit 2; }
            kernels=("$1" "$2"); shift 2 ;;
        --no-backend)
            sdpa_only+=("$1"); shift ;;
        *) echo "run_attn_bench: unknown option $1" >&2; usage >&2; exit 2 ;;
    esac
done

root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
bin="$root/build/bench/attn_decode"
mkdir -p "$out" || exit 1
out=$(cd "$out" && pwd)

if [ "${SKIP_BUILD:-0}" != 1 ]; then
    make -C "$root" --no-print-directory -j"$(nproc)" build/bench/attn_decode >"$out/build.log" 2>&1 || {
        echo "run_attn_bench: building attn_decode failed (see $out/build.log)" >&2
        tail -n 20 "$out/build.log" >&2
        exit 1
    }
fi
[ -x "$bin" ] || { echo "run_attn_bench: $bin is missing" >&2; exit 1; }

rc=0
t0=$SECONDS
echo "attn_decode ${common[*]} ${kernels[*]}" >&2
"$bin" ${common[@]+"${common[@]}"} ${kernels[@]+"${kernels[@]}"} >"$out/attn_decode.csv" 2> >(tee "$out/attn_decode.log" >&2) || {
    echo "run_attn_bench: attn_decode exited with $? (rows so far are kept)" >&2
    rc=1
}
t1=$SECONDS
echo "sdpa_decode.py ${common[*]} ${sdpa_only[*]}" >&2
"$py" "$root/bench/sdpa_decode.py" ${common[@]+"${common[@]}"} ${sdpa_only[@]+"${sdpa_only[@]}"} >"$out/sdpa_decode.csv" 2> >(tee "$out/sdpa_decode.log" >&2) || {
    echo "run_attn_bench: sdpa_decode.py exited with $? (rows so far are kept)" >&2
    rc=1
}
t2=$SECONDS
"$py" "$root/bench/attn_table.py" "$out/attn_decode.csv" "$out/sdpa_decode.csv" -o "$out/attn_table.md" || rc=1
echo "run_attn_bench: attn_decode $((t1 - t0)) s, sdpa_decode $((t2 - t1)) s; table in $out/attn_table.md" >&2
exit $rc
