#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (make fuzz) and runs each one
# for SECONDS (default 60) over its committed corpus. Fails when a target
# crashes, leaks, trips a sanitizer or a check, or times out on an input,
# and prints the saved reproducer and the command that replays it.
# Skips (exit 0, with a message) when clang or libFuzzer is missing.
#
#   scripts/run-fuzz.sh [--merge] [SECONDS] [TARGET...]
#
# TARGET: protocol, safetensors, model_config, serve_config, tokenizer (default: all).
# --merge: afterwards, fold the inputs that found new coverage into
#   tests/fuzz/corpus/TARGET (minimised by libFuzzer's -merge=1); without
#   it the committed corpus is only read, and new inputs stay under
#   BUILD/fuzz/run/TARGET/new.
# Environment: BUILD (build), FUZZ_CC (clang), FUZZ_JOBS (targets run at
# once; default: the CPU count, at most the number of targets).
set -uo pipefail
cd "$(dirname "$0")/.."

build=${BUILD:-build}
cc=${FUZZ_CC:-clang}
merge=0
if [ "${1:-}" = "--merge" ]; then merge=1; shift; fi
seconds=${1:-60}
case "$seconds" in ''|*[!0-9]*) echo "run-fuzz: SECONDS must be a whole number, got '$seconds'" >&2; exit 2 ;; esac
[ $# -gt 0 ] && shift
all=(protocol safetensors model_config serve_config tokenizer)
targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=("${all[@]}")

# The longest input tried, per target: every seed fits with room to grow.
max_len_of() {
  case "$1" in
    protocol) echo 4096 ;;
    safetensors) echo 8192 ;;
    model_config|serve_config|tokenizer) echo 4096 ;;
    *) echo "run-fuzz: unknown target '$1' (expected: ${all[*]})" >&2; return 1 ;;
  esac
}
for t in "${targets[@]}"; do max_len_of "$t" >/dev/null || exit 2; done

# Skip, not fail, when the toolchain cannot build a fuzzer at all.
if ! command -v "$cc" >/dev/null 2>&1; then
  echo "run-fuzz: SKIP: $cc not found (scripts/install-deps.sh installs clang and libFuzzer)"
  exit 0
fi
probe=$(mktemp -d)
trap 'rm -rf "$probe"' EXIT
printf '%s\n' '#include <stddef.h>' '#include <stdint.h>' \
  'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n);' \
  'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' > "$probe/probe.c"
if ! "$cc" -fsanitize=fuzzer,address,undefined "$probe/probe.c" -o "$probe/probe" >"$probe/log" 2>&1; then
  echo "run-fuzz: SKIP: $cc cannot link libFuzzer with ASan/UBSan (on Debian: libclang-rt-dev):"
  sed 's/^/  /' "$probe/log" | tail -5
  exit 0
fi

bins=(); for t in "${targets[@]}"; do bins+=("$build/fuzz/fuzz_$t"); done
if ! make --no-print-directory BUILD="$build" FUZZ_CC="$cc" "${bins[@]}"; then
  echo "run-fuzz: FAIL: the fuzz targets do not build"
  exit 1
fi

jobs=${FUZZ_JOBS:-$(nproc 2>/dev/null || echo 1)}
[ "$jobs" -gt ${#targets[@]} ] && jobs=${#targets[@]}
[ "$jobs" -lt 1 ] && jobs=1

# Leaks are failures; any UBSan report stops the run with a stack; an
# allocation the allocator refuses returns NULL, and the parsers must then
# fail cleanly with FR_ENOMEM, which the targets check.
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}

run_one() {
  local t=$1 dir="$build/fuzz/run/$1"
  rm -rf "$dir" && mkdir -p "$dir/new" "$dir/artifacts"
  "$build/fuzz/fuzz_$t" -max_total_time="$seconds" -max_len="$(max_len_of "$t")" -timeout=10 \
    -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$dir/artifacts/" \
    "$dir/new" "tests/fuzz/corpus/$t" >"$dir/log" 2>&1
  echo $? >"$dir/rc"
}

echo "run-fuzz: ${targets[*]}, ${seconds}s each, $jobs at a time"
running=0
for t in "${targets[@]}"; do
  run_one "$t" &
  running=$((running + 1))
  if [ $running -ge "$jobs" ]; then wait -n; running=$((running - 1)); fi
done
wait

failed=0
for t in "${targets[@]}"; do
  dir="$build/fuzz/run/$t"
  rc=$(cat "$dir/rc" 2>/dev/null || echo 1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$dir/log" | tail -1)
  cov=$(grep -E '^#[0-9]+.*(DONE|pulse|NEW|REDUCE|INITED).*cov: ' "$dir/log" | tail -1 |
        sed -E 's/.*(cov: [0-9]+ ft: [0-9]+ corp: [0-9]+\/[^ ]+).*/\1/')
  artifacts=$(find "$dir/artifacts" -type f 2>/dev/null)
  if [ "$rc" -eq 0 ] && [ -z "$artifacts" ]; then
    echo "ok   fuzz/$t: ${execs:-?} runs, ${cov:-no coverage line}"
  else
    failed=$((failed + 1))
    echo "FAIL fuzz/$t (exit $rc): ${execs:-?} runs"
    grep -E 'ERROR: |SUMMARY: |check failed|runtime error' "$dir/log" | head -10 | sed 's/^/     /'
    for a in $artifacts; do
      echo "     reproducer: $a"
      echo "     replay:     $build/fuzz/fuzz_$t $a"
    done
    echo "     log:        $dir/log"
  fi
  if [ $merge -eq 1 ] && [ "$rc" -eq 0 ]; then
    "$build/fuzz/fuzz_$t" -merge=1 -max_len="$(max_len_of "$t")" "tests/fuzz/corpus/$t" "$dir/new" \
      >"$dir/merge.log" 2>&1 || { echo "FAIL fuzz/$t: merge failed ($dir/merge.log)"; failed=$((failed + 1)); }
  fi
done
[ $failed -eq 0 ]
