#!/usr/bin/env bash
# Runs every CPU test: the source checks (the include graph against the
# layers of docs/architecture.md, function lengths), the cmocka unit tests
# under BUILD/tests, then the integration scripts in tests/integration (each
# starts real processes), the fault harness (tests/reliability, short
# form), the batch-invariance tests at two BLAS thread
# counts, then the libFuzzer targets of tests/fuzz (scripts/run-fuzz.sh).
# Prints one summary line, "N passed, N failed", and exits non-zero on failure.
set -uo pipefail
build=${1:-build}
passed=0; failed=0; failures=()

for check in check-layers long-functions; do
  if out=$(scripts/$check.sh 2>&1); then
    passed=$((passed + 1)); echo "ok   check/$check"
  else
    failed=$((failed + 1)); failures+=("check/$check"); echo "FAIL check/$check"; echo "$out" | tail -40
  fi
done

for t in "$build"/tests/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t"); t0=$SECONDS
  if out=$("$t" 2>&1); then
    passed=$((passed + 1)); echo "ok   unit/$name ($((SECONDS - t0)) s)"
  else
    failed=$((failed + 1)); failures+=("unit/$name"); echo "FAIL unit/$name"; echo "$out" | tail -40
  fi
  echo "$out" | grep -E "SKIP|skipped" | sed 's/^/     /' || true
done

for t in tests/integration/*.sh; do
  [ -f "$t" ] || continue
  name=$(basename "$t" .sh); t0=$SECONDS
  if out=$(BUILD="$build" bash "$t" 2>&1); then
    passed=$((passed + 1)); echo "ok   integration/$name ($((SECONDS - t0)) s)"
  else
    failed=$((failed + 1)); failures+=("integration/$name"); echo "FAIL integration/$name"; echo "$out" | tail -40
  fi
done

# The fault harness, short form (tests/reliability/README.md; the soak runs
# on demand: tests/reliability/run.sh --soak SECONDS).
if out=$(BUILD="$build" bash tests/reliability/run.sh 2>&1); then
  passed=$((passed + 1)); echo "ok   reliability"
else
  failed=$((failed + 1)); failures+=("reliability"); echo "FAIL reliability"; echo "$out" | tail -40
fi

# The batch-invariance test again at two BLAS thread counts: deterministic
# mode promises the same numbers whatever the count (docs/determinism.md).
# (unit/test_determinism sets its own thread counts, 1 to 4, case by case, so
# the variable would not change it: it runs once, above.)
for threads in 1 4; do
  for t in tests/integration/cli_rollout.sh; do
    name=$(basename "$t" .sh)
    case $t in *.sh) run=(bash "$t") ;; *) run=("$t") ;; esac
    if out=$(OPENBLAS_NUM_THREADS=$threads BUILD="$build" "${run[@]}" 2>&1); then
      passed=$((passed + 1)); echo "ok   threads$threads/$name"
    else
      failed=$((failed + 1)); failures+=("threads$threads/$name"); echo "FAIL threads$threads/$name"; echo "$out" | tail -40
    fi
  done
done

# The libFuzzer targets (tests/fuzz), FR_FUZZ_SECONDS each (default 20: the
# suite stays inside its time budget; longer campaigns run on demand with
# scripts/run-fuzz.sh SECONDS).
if out=$(BUILD="$build" scripts/run-fuzz.sh "${FR_FUZZ_SECONDS:-20}" 2>&1); then
  passed=$((passed + 1)); echo "ok   fuzz"; echo "$out" | grep -E "^(ok|run-fuzz: SKIP)" | sed 's/^/     /'
else
  failed=$((failed + 1)); failures+=("fuzz"); echo "FAIL fuzz"; echo "$out" | tail -40
fi

[ $failed -gt 0 ] && printf 'failed: %s\n' "${failures[@]}"
echo "$passed passed, $failed failed"
[ $failed -eq 0 ]
