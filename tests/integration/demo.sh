#!/usr/bin/env bash
# `make demo`'s script (examples/demo/run.sh) as a new user runs it: the
# bundled model served with an NVFP4 KV cache, 3 text prompts x 4 samples
# from the Python client, each with text, log-probs and a KL against BF16 KV,
# a dashboard that answers, a summary line and a clean stop; in under 2
# minutes (the issue's budget on 2 cores).
set -euo pipefail
build=${BUILD:-build}
fail() { echo "demo: $*" >&2; exit 1; }
[ -f models/demo/model.safetensors ] || fail "the bundled model models/demo is missing"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
start=$(date +%s)
examples/demo/run.sh "$build" > "$out" 2>&1 || { cat "$out" >&2; fail "examples/demo/run.sh failed"; }
secs=$(($(date +%s) - start))
cat "$out"
[ "$secs" -lt 120 ] || fail "took $secs s (budget 120 s)"
[ "$(grep -c '^  \[[0-2]\.[0-3]\] KL [0-9.e+-]*, top-1 [0-9]*%: ' "$out")" -eq 12 ] ||
  fail "not 12 monitored samples"
[ "$(grep -c '^        log-probs: ' "$out")" -eq 12 ] || fail "not 12 log-prob lines"
grep -q '^demo: dashboard http://127.0.0.1:[0-9]*/dashboard (HTTP 200 ' "$out" || fail "no working dashboard"
grep -Eq '^demo: 3 prompts x 4 samples, [0-9]+ tokens in .* mean KL [0-9.e+-]+ nats/token, top-1 agreement' "$out" ||
  fail "no summary line"
grep -Eq 'INFO  serve: served (7[6-9][0-9]|[89][0-9]{2}|[0-9]{4,}) tokens in [0-9.]+ s' "$out" ||
  fail "no summary of the run in the server's log"
grep -q '^demo: server stopped cleanly' "$out" || fail "the server did not stop cleanly"
echo "demo: all checks passed in $secs s"
