#!/usr/bin/env bash
# The HTTP API (docs/http.md) on the bundled demo model (byte-level: text in
# and out) on the CPU: serve_http.py drives every endpoint with aiohttp
# (greedy /generate and /v1/completions equal to `fp4rollout generate
# --greedy`, streams, 2,000 concurrent streams, abort, pause modes, weights
# from disk, memory release, penalties, text and stop strings equal to the
# ZeroMQ client's, refusals); the text checks again on synthetic:tiny-qwen3
# with Qwen3's tokenizer when ../shared/tokenizers/qwen3 is there; curl
# checks the tokens and roles on another server; the servers stop cleanly
# on SIGINT.
set -euo pipefail
name=serve_http
source "$(dirname "$0")/serve_setup.bash"
$py -c 'import aiohttp' 2>/dev/null || fail "python3-aiohttp is missing (scripts/install-deps.sh)"
model=models/demo
"$bin" generate --model "$model" --backend cpu --kv f32 --prompt "def " --greedy --max-tokens 16 --json \
  > "$dir/ref.jsonl" 2> "$dir/ref.err" || fail "generate failed: $(cat "$dir/ref.err")"

hport=$(free_port)
start_server s "{\"model\": \"$PWD/$model\", \"backend\": \"cpu\", \"kv_dtype\": \"f32\", \"max_seqs\": 64,
 \"kv_blocks\": 512, \"metrics_port\": $hport, \"http\": {\"max_body_bytes\": 65536},
 \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
http=http://127.0.0.1:$hport
curl -sf "$http/health" | grep -q serving || fail "/health"
code=$(curl -s -o "$dir/c.json" -w '%{http_code}' "$http/generate" -d '{"text": "def ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}')
[ "$code" = 200 ] && grep -q '"output_ids":\[95,95,105,110\]' "$dir/c.json" || fail "curl /generate: $code $(cat "$dir/c.json")"
PYTHONPATH=trainer_bridge/client/python FP4ROLLOUT_CLIENT_LIB=$build/libfp4rollout_client.so \
  timeout 300 $py "$(dirname "$0")/serve_http.py" "$http" "$ep" "$dir/ref.jsonl" "$dir" "$PWD/$model" ||
  fail "serve_http.py failed"
kill -INT "${pids[0]}"
wait "${pids[0]}" || fail "the server did not exit cleanly"
grep -q "serve: stopped" "$dir/s.log" || fail "no clean stop"

# Text through Qwen3's tokenizer (multi-byte characters across tokens).
qwen=${FR_TOKENIZERS_DIR:-../shared/tokenizers}/qwen3
if [ -f "$qwen/tokenizer.json" ]; then
  hport=$(free_port)
  start_server q "{\"model\": \"synthetic:tiny-qwen3\", \"tokenizer\": \"$(cd "$qwen" && pwd)\", \"backend\": \"cpu\",
   \"kv_dtype\": \"f32\", \"max_seqs\": 8, \"kv_blocks\": 96, \"metrics_port\": $hport,
   \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
  PYTHONPATH=trainer_bridge/client/python FP4ROLLOUT_CLIENT_LIB=$build/libfp4rollout_client.so \
    timeout 300 $py "$(dirname "$0")/serve_http.py" "http://127.0.0.1:$hport" "$ep" --text ||
    fail "serve_http.py --text failed on Qwen3's tokenizer"
  kill -INT "${pids[-1]}"
  wait "${pids[-1]}" || fail "the Qwen3 server did not exit cleanly"
else
  echo "$name: SKIP the Qwen3 tokenizer checks: $qwen is absent"
fi

# Tokens and roles: read (metrics_http.token), client, trainer.
hport=$(free_port)
start_server t "{\"model\": \"synthetic:tiny\", \"backend\": \"cpu\", \"kv_dtype\": \"f32\", \"max_seqs\": 8,
 \"metrics_port\": $hport, \"metrics_http\": {\"token\": \"R\"},
 \"http\": {\"client_token\": \"C\", \"trainer_token\": \"T\"}, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
http=http://127.0.0.1:$hport
st() { curl -s -o /dev/null -w '%{http_code}' "$@"; }
body='{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}'
[ "$(st "$http/metrics")" = 401 ] || fail "metrics without a token"
[ "$(st -H 'Authorization: Bearer R' "$http/metrics")" = 200 ] || fail "metrics with the read token"
[ "$(st -H 'Authorization: Bearer R' "$http/generate" -d "$body")" = 403 ] || fail "generate with the read token"
[ "$(st "$http/generate" -d "$body")" = 401 ] || fail "generate without a token"
[ "$(st -H 'Authorization: Bearer C' "$http/generate" -d "$body")" = 200 ] || fail "generate with the client token"
[ "$(st -H 'Authorization: Bearer C' "$http/pause_generation" -d '{}')" = 403 ] || fail "pause with the client token"
[ "$(st -H 'Authorization: Bearer T' "$http/pause_generation" -d '{}')" = 200 ] || fail "pause with the trainer token"
[ "$(st -H 'Authorization: Bearer T' "$http/continue_generation" -X POST)" = 200 ] || fail "continue"
[ "$(st -H 'Authorization: Bearer T' "$http/metrics")" = 200 ] || fail "a trainer reads metrics too"
echo "serve_http: ok"
