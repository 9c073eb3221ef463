#!/usr/bin/env bash
# Black-box checks of `fp4rollout serve` and its clients (docs/protocol.md)
# on the built-in synthetic model over loopback: hello; 8 prompts x 4
# samples streamed and bitwise equal to `fp4rollout rollout` (both in
# deterministic mode: the server batches them with other requests); abort of one request;
# pause abort, pause wait, held requests and resume; stats; malformed
# messages (garbage, wrong types, unknown types, a frame declaring a huge
# array) answered with errors while the server keeps serving; a client that
# vanishes mid-stream has its samples ended; two
# clients at once with the same request ids; the Python client; clean
# shutdown on SIGTERM with a done for every open sample; CLI errors.
set -euo pipefail
name=serve_bridge
source "$(dirname "$0")/serve_setup.bash"

port=$(free_port)
ep=tcp://127.0.0.1:$port
cat > "$dir/serve.json" <<EOF
{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16, "deterministic": true,
 "coordinator": {"bind": "127.0.0.1", "port": $port}}
EOF

start_server() {
  "$bin" serve --config "$dir/serve.json" 2> "$dir/serve.log" &
  server_pid=$!
  for _ in $(seq 200); do
    grep -q "listening on" "$dir/serve.log" 2>/dev/null && return 0
    kill -0 "$server_pid" 2>/dev/null || fail "the server exited at start"
    sleep 0.05
  done
  fail "the server did not start listening"
}
c() { timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 "$@"; }
# Waits until the server's scheduler runs something.
wait_running() {
  for _ in $(seq 400); do
    c stats | $py -c 'import json, sys; sys.exit(0 if json.load(sys.stdin)["scheduler"]["running"] > 0 else 1)' &&
      return 0
    sleep 0.02
  done
  fail "nothing started running"
}
expect_error() { # PATTERN ARGS...: fp4rollout ARGS fails with PATTERN on stderr
  local pattern=$1; shift
  if timeout 30 "$bin" "$@" >/dev/null 2>"$dir/err"; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
json_check() { # FILE PYTHON-EXPRESSION-ON-d MESSAGE
  $py -c "import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if ($2) else 1)" "$1" ||
    fail "$3: $(cat "$1")"
}

$py - "$dir" <<'PY'
import random, sys
random.seed(8)
for name, count in (("p8", 8), ("q8", 8)):
    with open(f"{sys.argv[1]}/{name}.txt", "w") as f:
        for _ in range(count):
            n = random.randint(2, 60)
            f.write(",".join(["256"] + [str(random.randint(0, 255)) for _ in range(n)]) + "\n")
PY
head -4 "$dir/p8.txt" > "$dir/p4.txt"
head -2 "$dir/q8.txt" > "$dir/q2.txt"
ref() { # PROMPTS SEED OUT
  "$bin" rollout --model synthetic:tiny --backend cpu --kv f32 --max-seqs 16 --prompts "$1" --n 4 \
    --max-tokens 40 --temperature 1 --seed "$2" --deterministic --json > "$3" 2>/dev/null ||
    fail "rollout reference failed"
}
ref "$dir/p8.txt" 11 "$dir/ref11.jsonl"
ref "$dir/q8.txt" 12 "$dir/ref12.jsonl"
# Streamed samples equal the reference: each (request, sample) once, same
# tokens, log-probs and finish reasons.
same_as() { # GOT REF
  $py - "$1" "$2" <<'PY' || fail "$1 differs from $2"
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]
ref = {(r["request_id"], r["sample"]): r for r in map(json.loads, open(sys.argv[2]))}
keys = [(r["request_id"], r["sample"]) for r in got]
assert len(keys) == len(set(keys)) == len(ref) == 32, f"{len(keys)} samples, {len(set(keys))} distinct"
for r in got:
    e = ref[(r["request_id"], r["sample"])]
    assert r["token_ids"] == e["token_ids"], (r["request_id"], r["sample"])
    assert r["logprobs"] == e["logprobs"], (r["request_id"], r["sample"])
    assert r["finish_reason"] == e["finish_reason"]
    assert r["n_tokens"] == len(r["token_ids"]) and r["ttft_ms"] is not None and r["total_ms"] >= r["ttft_ms"]
PY
}

start_server

# hello
c hello > "$dir/hello.json" || fail "hello failed"
json_check "$dir/hello.json" 'd["model"] == "synthetic:tiny" and d["backend"] == "cpu" and d["kv_dtype"] == "f32" and d["vocab_size"] == 272 and d["max_seqs"] == 16 and d["kv_blocks"] == 256 and d["eos_token_ids"] == [257]' "hello reply"

# 8 prompts x 4 samples, streamed; the client itself checks contiguous
# deltas, one done per sample and streamed tokens = the done's count.
c generate --prompts "$dir/p8.txt" --n 4 --max-tokens 40 --temperature 1 --seed 11 > "$dir/g.jsonl" ||
  fail "generate failed"
same_as "$dir/g.jsonl" "$dir/ref11.jsonl"

# Abort one request of three once its tokens flow.
c generate --prompts "$dir/p4.txt" --first-id 50 --n 2 --max-tokens 600 --ignore-eos --temperature 1 \
  --abort-id 51 --abort-after 3 > "$dir/abort.jsonl" 2> "$dir/abort.err" || fail "generate with abort failed: $(cat "$dir/abort.err")"
grep -q "aborted request 51: 2 samples ended" "$dir/abort.err" || fail "abort reply: $(cat "$dir/abort.err")"
$py - "$dir/abort.jsonl" <<'PY' || fail "abort of one request"
import json, sys
rows = {(r["request_id"], r["sample"]): r for r in map(json.loads, open(sys.argv[1]))}
assert len(rows) == 8
for (req, s), r in rows.items():
    if req == 51:
        assert r["finish_reason"] == "abort" and len(r["token_ids"]) < 600, r["finish_reason"]
    else:
        assert r["finish_reason"] == "length" and len(r["token_ids"]) == 600
PY

# pause abort: samples in flight end now with their partial tokens.
c generate --prompts "$dir/p4.txt" --first-id 60 --n 2 --max-tokens 1500 --ignore-eos > "$dir/pa.jsonl" 2>&1 &
gen=$!
wait_running
c pause --mode abort > "$dir/pause.json" || fail "pause abort failed"
wait $gen || fail "the generate hit by pause abort did not end cleanly: $(cat "$dir/pa.jsonl")"
json_check "$dir/pause.json" 'd["state"] == "paused" and d["mode"] == "abort" and d["aborted"] >= 1' "pause abort reply"
$py - "$dir/pa.jsonl" "$(cat "$dir/pause.json")" <<'PY' || fail "pause abort: $(cat "$dir/pa.jsonl")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
aborted = json.loads(sys.argv[2])["aborted"]
assert len(rows) == 8 and sum(r["finish_reason"] == "abort" for r in rows) == aborted
assert all(r["finish_reason"] == "abort" or len(r["token_ids"]) == 1500 for r in rows)
PY
# While paused, a generate is held; resume releases it.
c generate --prompts "$dir/q2.txt" --first-id 70 --max-tokens 20 > "$dir/held.jsonl" &
gen=$!
for _ in $(seq 200); do
  c stats > "$dir/stats.json"
  $py -c 'import json,sys; sys.exit(0 if json.load(open(sys.argv[1]))["server"]["held_requests"] == 2 else 1)' \
    "$dir/stats.json" && break
  sleep 0.02
done
json_check "$dir/stats.json" 'd["server"]["state"] == "paused" and d["server"]["held_requests"] == 2 and d["scheduler"]["running"] == 0' "stats while paused"
[ -s "$dir/held.jsonl" ] && fail "a held request produced output while paused"
c resume > "$dir/resume.json" || fail "resume failed"
json_check "$dir/resume.json" 'd["released"] == 2' "resume reply"
wait $gen || fail "the held generate failed after resume"
[ "$(wc -l < "$dir/held.jsonl")" -eq 2 ] || fail "held requests: $(cat "$dir/held.jsonl")"

# pause wait: the engine finishes what runs, then reports paused.
c generate --prompts "$dir/p4.txt" --first-id 80 --n 2 --max-tokens 700 --ignore-eos > "$dir/pw.jsonl" &
gen=$!
wait_running
c --timeout-ms 60000 pause --mode wait > "$dir/pause.json" || fail "pause wait failed"
c stats > "$dir/stats.json"
wait $gen || fail "the generate under pause wait failed"
json_check "$dir/pause.json" 'd["mode"] == "wait" and d["aborted"] == 0' "pause wait reply"
json_check "$dir/stats.json" 'd["server"]["state"] == "paused" and d["scheduler"]["running"] == 0 and d["server"]["open_requests"] == 0' "stats after pause wait"
$py -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 8 and all(r["finish_reason"] == "length" and len(r["token_ids"]) == 700 for r in rows)
' "$dir/pw.jsonl" || fail "pause wait ended samples early"
c resume > /dev/null || fail "resume failed"

# Malformed messages get an error naming the problem; the server goes on.
raw() { # HEX [EXTRA_FRAMES] -> the reply
  c send-raw --hex "$1" --extra-frames "${2:-0}" > "$dir/raw.json" || fail "send-raw $1 got no reply"
}
raw c1
json_check "$dir/raw.json" 'd["code"] == "bad_message" and "not valid msgpack" in d["message"] and d["request_id"] is None' "garbage"
raw 93010203
json_check "$dir/raw.json" '"must be a msgpack map" in d["message"]' "an array"
raw 81a17601
json_check "$dir/raw.json" '"missing key \"type\"" in d["message"]' "no type"
raw 84a474797065a867656e6572617465a17601aa726571756573745f696407a670726f6d7074a178
json_check "$dir/raw.json" 'd["code"] == "bad_message" and "\"prompt\" must be an array" in d["message"] and d["request_id"] == 7' "mistyped prompt"
raw 82a474797065a568656c6c6fa17602
json_check "$dir/raw.json" 'd["code"] == "unsupported_version" and "version 2" in d["message"]' "version 2"
raw 82a474797065a6746f6b656e73a17601
json_check "$dir/raw.json" '"is a message the server sends" in d["message"]' "a server message type"
raw 83a474797065a57374617473a17601a7766572626f7365c3
json_check "$dir/raw.json" '"unknown key \"verbose\"" in d["message"]' "an unknown key"
raw 82a474797065a568656c6c6fa17601 1
json_check "$dir/raw.json" '"2 frames" in d["message"]' "an extra frame"
raw 84a474797065a867656e6572617465a17601aa726571756573745f696409a670726f6d707492cd0100cd03e7
json_check "$dir/raw.json" 'd["code"] == "invalid_request" and "outside the vocabulary" in d["message"] and d["request_id"] == 9' "a token outside the vocabulary"
raw 82a474797065a3666f6fa17601
json_check "$dir/raw.json" '"unknown type \"foo\"" in d["message"]' "an unknown message type"
raw 81a178dd08000000
json_check "$dir/raw.json" 'd["code"] == "bad_message" and "declares" in d["message"]' "a frame declaring 2^27 elements"
c hello > /dev/null || fail "the server stopped answering after malformed messages"

# A client that vanishes mid-stream: its samples end early (the server finds
# it gone when its tokens cannot be delivered), the server serves on.
c stats > "$dir/vs0.json"
c generate --prompts "$dir/p8.txt" --n 4 --max-tokens 2000 --temperature 1 --seed 13 > /dev/null 2>&1 &
gv=$!
wait_running
kill -KILL $gv 2>/dev/null || true
wait $gv 2>/dev/null || true
for _ in $(seq 300); do
  c stats > "$dir/vs.json" && $py -c 'import json, sys; d = json.load(open(sys.argv[1])); sys.exit(0 if d["scheduler"]["running"] == 0 and d["server"]["open_requests"] == 0 else 1)' "$dir/vs.json" && break
  sleep 0.1
done
json_check "$dir/vs.json" 'd["scheduler"]["running"] == 0 and d["server"]["open_requests"] == 0' "the vanished client's samples ended"
$py -c 'import json, sys; a, b = (json.load(open(p))["scheduler"]["tokens_generated"] for p in sys.argv[1:3]); sys.exit(0 if b - a < 32 * 2000 // 2 else 1)' "$dir/vs0.json" "$dir/vs.json" ||
  fail "the vanished client's 32 samples ran to their 2000 tokens instead of ending"
c hello > /dev/null || fail "the server stopped answering after a client vanished"

# Two clients at once, with the same request ids, each get their own samples.
c generate --prompts "$dir/p8.txt" --n 4 --max-tokens 40 --temperature 1 --seed 11 > "$dir/c1.jsonl" &
g1=$!
c generate --prompts "$dir/q8.txt" --n 4 --max-tokens 40 --temperature 1 --seed 12 > "$dir/c2.jsonl" &
g2=$!
wait $g1 || fail "client 1 failed"
wait $g2 || fail "client 2 failed"
same_as "$dir/c1.jsonl" "$dir/ref11.jsonl"
same_as "$dir/c2.jsonl" "$dir/ref12.jsonl"

# The Python client.
BUILD="$build" timeout 120 $py "$(dirname "$0")/serve_python.py" "$ep" "$dir/p8.txt" "$dir/ref11.jsonl" ||
  fail "the Python client checks failed"

# stats add up.
c stats > "$dir/stats.json"
json_check "$dir/stats.json" 'd["server"]["bad_messages"] >= 8 and d["server"]["errors_sent"] >= 9 and d["server"]["samples_done"] == d["scheduler"]["finished"] and d["server"]["open_requests"] == 0 and d["server"]["queued_messages"] == 0 and d["scheduler"]["kv_blocks_used"] == 0' "final stats"

# A second server on the same port is refused, naming the endpoint.
expect_error "cannot bind tcp://127.0.0.1:$port" serve --config "$dir/serve.json"

# SIGTERM: every open sample gets its done (reason abort), then a clean exit.
c generate --prompts "$dir/p4.txt" --first-id 90 --n 2 --max-tokens 1500 --ignore-eos > "$dir/term.jsonl" &
gen=$!
wait_running
kill -TERM "$server_pid"
wait $gen || fail "the client lost samples at shutdown: $(cat "$dir/term.jsonl")"
wait "$server_pid" || fail "the server exited with an error on SIGTERM"
server_pid=
$py -c '
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 8 and all(r["finish_reason"] in ("abort", "length") for r in rows)
assert any(r["finish_reason"] == "abort" for r in rows)
' "$dir/term.jsonl" || fail "shutdown: $(cat "$dir/term.jsonl")"
grep -q "open samples ended with reason abort" "$dir/serve.log" || fail "no shutdown line in the log"
grep -q "serve: stopped" "$dir/serve.log" || fail "the server did not stop cleanly"

# Command-line errors.
expect_error "--port expects an integer in \[1, 65535\], got 'x'" serve --port=x
expect_error "--max-num-seqs expects an integer in \[1, 65536\], got '0'" serve --max-num-seqs 0
expect_error "command line: coordinator.port and metrics_pub_port are both 6000" serve --port 6000 --metrics-pub-port 6000
expect_error "unknown or ambiguous option '--bogus'" serve --bogus
expect_error "cannot read\|No such file\|cannot open" serve --config "$dir/none.json"
echo '{"kv_dtpye": "f32"}' > "$dir/typo.json"
expect_error 'did you mean "kv_dtype"' serve --config "$dir/typo.json"
echo '{"tp": 2}' > "$dir/tp2.json"
expect_error "tp 2 needs several ranks" serve --config "$dir/tp2.json"
{ out=$("$bin" serve --help) && grep -q "usage: fp4rollout serve" <<< "$out"; } || fail "serve --help"
{ out=$("$cli" --help) && grep -q "usage: fp4rollout-client" <<< "$out"; } || fail "fp4rollout-client --help"
echo "serve_bridge: all checks passed"
