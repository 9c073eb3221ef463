#!/usr/bin/env bash
# Pause modes and continued samples (docs/protocol.md, "pause"; docs/sampling.md,
# "Continuing a sample") against `fp4rollout serve` on synthetic:tiny,
# deterministic with an f32 KV cache, 4 sequences at once: wait holds what
# did not start, keep freezes samples across a weight update (versions
# switch mid-sample; with recompute their tokens after it equal a
# continuation on the new weights, bitwise), the transitions between modes,
# and samples ended by abort or pause("abort") continued bitwise as if never
# stopped (serve_pause.py, the Python client). fp4rollout-client's pause
# --mode keep and resume --recompute. FR_TEST_BACKEND=cuda serves on a GPU.
set -euo pipefail
name=serve_pause
source "$(dirname "$0")/serve_setup.bash"
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
$py -c 'import numpy' 2>/dev/null || fail "python3-numpy is missing (scripts/install-deps.sh)"

# FR_TEST_BACKEND=cuda: the same on a GPU (BF16 KV: the GPU has no f32 cache).
engine='"backend": "cpu", "kv_dtype": "f32"'
[ "${FR_TEST_BACKEND:-cpu}" = cuda ] && engine='"backend": "cuda", "kv_dtype": "bf16", "kv_blocks": 256'
start_server s "{\"model\": \"synthetic:tiny\", $engine, \"max_seqs\": 4, \"deterministic\": true,
 \"metrics_port\": 0, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
$cli push-weights --model synthetic:tiny:7 --export "$dir/w7.bin" > "$dir/w7.jsonl" || fail "export synthetic:tiny:7"
$cli push-weights --model synthetic:tiny --export "$dir/w0.bin" > "$dir/w0.jsonl" || fail "export synthetic:tiny"
BUILD="$build" timeout 400 $py "$(dirname "$0")/serve_pause.py" "$ep" "$dir/w7.bin" "$dir/w7.jsonl" \
  "$dir/w0.bin" "$dir/w0.jsonl" || fail "the Python client's checks failed"

# fp4rollout-client: pause --mode keep, a second pause answered at once,
# resume --recompute; --recompute without keep is a usage error.
c() { timeout 60 "$cli" --endpoint "$ep" "$@"; }
c pause --mode keep --recompute | grep -q '"mode":"keep"' || fail "pause --mode keep --recompute"
c stats | grep -q '"state":"paused"' || fail "not paused after pause --mode keep"
c pause --mode wait | grep -q '"mode":"wait"' || fail "pause --mode wait while frozen"
c resume --recompute | grep -q '"released":0' || fail "resume --recompute"
c stats | grep -q '"state":"running"' || fail "not running after resume"
if c pause --mode wait --recompute 2> "$dir/usage.err"; then fail "--recompute with --mode wait was accepted"; fi
grep -q "recompute goes with --mode keep" "$dir/usage.err" || fail "usage error: $(cat "$dir/usage.err")"
echo "serve_pause: ok"
