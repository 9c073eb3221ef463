#!/usr/bin/env bash
# Runs every CPU test: the source checks (the include graph against the
# layers of docs/architecture.md, function lengths), the cmocka unit tests
# under BUILD/tests, then the integration scripts in tests/integration (each
# starts real processes), the batch-invariance tests at two BLAS thread
# counts, the libFuzzer targets of tests/fuzz (scripts/run-fuzz.sh), and
# last, alone, the tests whose checks have deadlines measured in seconds:
# serve_mpi (a tp 2 job under mpirun must shut down cleanly within 30 s of
# SIGTERM with every sample ended) and the fault harness (tests/reliability,
# short form: its heartbeat and rank timeouts are seconds long).
#
# Tests run FR_TEST_JOBS at a time (default: the CPU count, at most 2), the
# longest first; each prints its block (ok/FAIL, seconds, the tail of its
# output on failure) when it ends. With more than one at a time, a test
# whose BLAS thread count is not set runs with one thread
# (OPENBLAS_NUM_THREADS=1) so that tests side by side do not fight over the
# cores (OpenBLAS threads spin while they wait): every test holds at any
# thread count.
# Prints one summary line, "N passed, N failed", and exits non-zero on failure.
set -uo pipefail
build=${1:-build}
passed=0; failed=0; failures=()
jobs=${FR_TEST_JOBS:-$(n=$(nproc 2>/dev/null || echo 1); echo $((n < 2 ? n : 2)))}
case "$jobs" in ''|*[!0-9]*|0) echo "run-tests: FR_TEST_JOBS must be a positive whole number, got '$jobs'" >&2; exit 2 ;; esac
[ "$jobs" -gt 1 ] && export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-1}
out_dir=$(mktemp -d)
trap 'rm -rf "$out_dir"' EXIT

for check in check-layers long-functions; do
  if out=$(scripts/$check.sh 2>&1); then
    passed=$((passed + 1)); echo "ok   check/$check"
  else
    failed=$((failed + 1)); failures+=("check/$check"); echo "FAIL check/$check"; echo "$out" | tail -40
  fi
done

# The test list: NAME and a command line (run with bash -c) per entry.
names=(); cmds=()
add() { names+=("$1"); cmds+=("$2"); }
for t in "$build"/tests/test_*; do
  [ -x "$t" ] && add "unit/$(basename "$t")" "$(printf '%q' "$t")"
done
for t in tests/integration/*.sh; do
  [ -f "$t" ] && add "integration/$(basename "$t" .sh)" "BUILD=$(printf '%q' "$build") bash $(printf '%q' "$t")"
done
# The batch-invariance test again at two BLAS thread counts: deterministic
# mode promises the same numbers whatever the count (docs/determinism.md).
# (unit/test_determinism sets its own thread counts, 1 to 4, case by case, so
# the variable would not change it: it runs once, above.)
for threads in 1 4; do
  add "threads$threads/cli_rollout" "OPENBLAS_NUM_THREADS=$threads BUILD=$(printf '%q' "$build") bash tests/integration/cli_rollout.sh"
done
# The libFuzzer targets (tests/fuzz), FR_FUZZ_SECONDS each (default 20: the
# suite stays inside its time budget; longer campaigns run on demand with
# scripts/run-fuzz.sh SECONDS), one target at a time here: the other
# tests share the cores.
add fuzz "BUILD=$(printf '%q' "$build") FUZZ_JOBS=\${FUZZ_JOBS:-1} scripts/run-fuzz.sh ${FR_FUZZ_SECONDS:-20}"

# The longest tests start first, so that no long one is left for the end
# with the other slot idle (seconds measured on two cores; order only).
slow=(unit/test_engine_golden integration/tp_cpu fuzz unit/test_eval_kl unit/test_determinism
      integration/cli_calibrate_eval integration/dapo_smoke integration/dapo_arith unit/test_scheduler_monitor integration/serve_bridge
      integration/cli_generate integration/rollout_mpi integration/serve_pause)
# Run after the others, one at a time, with the machine to themselves.
alone=(integration/serve_mpi)
order=()
for s in "${slow[@]}"; do
  for i in "${!names[@]}"; do [ "${names[$i]}" = "$s" ] && order+=("$i"); done
done
for i in "${!names[@]}"; do
  case " ${slow[*]} ${alone[*]} " in *" ${names[$i]} "*) ;; *) order+=("$i") ;; esac
done

# report I SECONDS STATUS: the block of test I.
report() {
  local name=${names[$1]} f=$out_dir/$1.out
  if [ "$3" -eq 0 ]; then
    passed=$((passed + 1)); echo "ok   $name ($2 s)"
    case $name in
      fuzz) grep -E "^(ok|run-fuzz: SKIP)" "$f" | sed 's/^/     /' ;;
      *) grep -E "SKIP|skipped" "$f" | sed 's/^/     /' ;;
    esac
  else
    failed=$((failed + 1)); failures+=("$name"); echo "FAIL $name ($2 s)"
    grep -m 5 -E "FAIL|[Ff]ailed" "$f" | sed 's/^/     /'   # the reason, which a log dump may push out of the tail
    tail -40 "$f"
  fi
}

declare -A running=()   # pid -> test index
declare -A started=()   # test index -> start time
# finish_one: waits for any running test and reports it.
finish_one() {
  local pid rc
  wait -n -p pid "${!running[@]}"; rc=$?
  local i=${running[$pid]}
  unset "running[$pid]"
  report "$i" $((SECONDS - ${started[$i]})) "$rc"
}
for i in "${order[@]}"; do
  while [ ${#running[@]} -ge "$jobs" ]; do finish_one; done
  started[$i]=$SECONDS
  bash -c "${cmds[$i]}" > "$out_dir/$i.out" 2>&1 < /dev/null &
  running[$!]=$i
done
while [ ${#running[@]} -gt 0 ]; do finish_one; done
for s in "${alone[@]}"; do
  for i in "${!names[@]}"; do
    [ "${names[$i]}" = "$s" ] || continue
    t0=$SECONDS
    bash -c "${cmds[$i]}" > "$out_dir/$i.out" 2>&1 < /dev/null
    report "$i" $((SECONDS - t0)) $?
  done
done

# The fault harness, short form (tests/reliability/README.md; the soak runs
# on demand: tests/reliability/run.sh --soak SECONDS), with the machine to
# itself.
t0=$SECONDS
if out=$(BUILD="$build" bash tests/reliability/run.sh 2>&1); then
  passed=$((passed + 1)); echo "ok   reliability ($((SECONDS - t0)) s)"
else
  failed=$((failed + 1)); failures+=("reliability"); echo "FAIL reliability"; echo "$out" | tail -40
fi

[ $failed -gt 0 ] && printf 'failed: %s\n' "${failures[@]}"
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
