#!/usr/bin/env bash
# Text through `fp4rollout serve` (docs/protocol.md, generate's text keys;
# docs/sampling.md, "Stop strings"): the Python client's checks
# (serve_text.py: text prompts through the server's tokenizer, streamed
# text a prefix of each sample's and never half a character, stop strings
# spanning tokens and delta boundaries, multi-byte ones, include, the
# refusals of a server without a tokenizer) on the byte-level synthetic
# model and, when ../shared/tokenizers/qwen3 is there, on synthetic:tiny-qwen3
# with Qwen3's tokenizer; fp4rollout-client, `rollout` and `generate` with
# the same prompt, seed and stop string give the Python client's sample
# and text; a server of two engines under mpirun the same as one process;
# refusals at start (a tokenizer that does not fit the model).
set -euo pipefail
name=serve_text
source "$(dirname "$0")/serve_setup.bash"
qwen=${FR_TOKENIZERS_DIR:-../shared/tokenizers}/qwen3
config() { # MODEL [EXTRA-KEYS]
  echo "{\"model\": \"$1\", \"backend\": \"cpu\", \"kv_dtype\": \"f32\", \"max_seqs\": 8, \"kv_blocks\": 96, \"metrics_port\": 0, ${2:-}
         \"sampling\": {\"max_tokens\": 64}, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
}

start_server byte "$(config synthetic:tiny)"
byte_ep=$ep
start_server bare "$(config synthetic:tiny-qwen3)"
bare_ep=$ep
grep -q "tokenizer none (token ids only)" "$dir/bare.log" || fail "the server without a tokenizer does not say so"
qwen_ep=-
if [ -f "$qwen/tokenizer.json" ]; then
  start_server qwen "$(config synthetic:tiny-qwen3 "\"tokenizer\": \"$(cd "$qwen" && pwd)\",")"
  qwen_ep=$ep
else
  echo "$name: SKIP the Qwen3 tokenizer checks: $qwen is absent"
fi
timeout 300 $py "$(dirname "$0")/serve_text.py" "$byte_ep" "$qwen_ep" "$bare_ep" "$dir/py.json" > "$dir/py.log" 2>&1 ||
  fail "the Python client's checks failed"

# The Python client's stopped sample through fp4rollout-client, rollout and
# generate: the same prompt, seed and stop string give the same sample.
read -r stop < <($py -c 'import json, sys; print(json.dumps(json.load(open(sys.argv[1]))[1]["stop_str"]))' "$dir/py.json")
stop=$($py -c 'import json, sys; print(json.loads(sys.argv[1]), end="")' "$stop")
echo '"def __init__(self"' > "$dir/p.txt"
opts=(--n 1 --temperature 0.9 --seed 7 --max-tokens 64)
timeout 60 "$cli" --endpoint "$byte_ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" "${opts[@]}" \
  --stop "$stop" > "$dir/c.jsonl" || fail "fp4rollout-client generate failed"
"$bin" rollout --model synthetic:tiny --backend cpu --kv f32 --prompts "$dir/p.txt" "${opts[@]}" --stop "$stop" \
  --json > "$dir/r.jsonl" 2> "$dir/r.err" || fail "rollout failed: $(cat "$dir/r.err")"
"$bin" generate --model synthetic:tiny --backend cpu --kv f32 --prompt "def __init__(self" "${opts[@]}" --stop "$stop" \
  --json > "$dir/g.jsonl" 2> "$dir/g.err" || fail "generate failed: $(cat "$dir/g.err")"
$py - "$dir/py.json" "$dir/c.jsonl" "$dir/r.jsonl" "$dir/g.jsonl" <<'PY' || fail "the clients and commands disagree"
import json, sys
py = json.load(open(sys.argv[1]))[1]
for path in sys.argv[2:]:
    (line,) = [json.loads(x) for x in open(path)]
    for key in ("token_ids", "text", "finish_reason", "stop_str"):
        assert line[key] == py[key], (path, key, line[key], py[key])
PY
grep -q '"prompt_token_ids":\[256,100,101,102,' "$dir/c.jsonl" || fail "fp4rollout-client does not print prompt_token_ids"

# Two engines under mpirun: text and stop strings cross the ranks.
if command -v mpirun >/dev/null 2>&1; then
  mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
  [ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
  start_server mpi "$(config synthetic:tiny)" timeout 120 "${mpi[@]}" -np 2
  printf '"def __init__(self"\n"def __init__(self"\n' > "$dir/p2.txt"
  timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p2.txt" "${opts[@]}" \
    --stop "$stop" > "$dir/m.jsonl" || fail "generate on two engines failed"
  $py - "$dir/c.jsonl" "$dir/m.jsonl" <<'PY' || fail "two engines' samples differ from one process's"
import json, sys
(one,) = [json.loads(x) for x in open(sys.argv[1])]
two = [json.loads(x) for x in open(sys.argv[2])]
assert len(two) == 2, two
for line in two:   # requests 0 and 1 land on the two engines
    for key in ("token_ids", "text", "finish_reason", "stop_str", "prompt_token_ids"):
        assert line[key] == one[key], (key, line[key], one[key])
PY
else
  echo "$name: SKIP the two-engine checks: no mpirun"
fi

# Refused at start: a tokenizer whose ids the model cannot embed.
set +e
"$bin" serve --model synthetic:tiny --backend cpu --port "$(free_port)" --metrics-port 0 \
  --tokenizer "$dir/none" > /dev/null 2> "$dir/refused.err"
rc=$?
set -e
[ $rc = 1 ] && grep -q "cannot" "$dir/refused.err" || fail "a missing tokenizer: exit $rc, $(cat "$dir/refused.err")"
if [ -f "$qwen/tokenizer.json" ]; then
  set +e
  "$bin" serve --model synthetic:tiny --backend cpu --port "$(free_port)" --metrics-port 0 --tokenizer "$qwen" \
    > /dev/null 2> "$dir/refused.err"
  rc=$?
  set -e
  [ $rc = 2 ] && grep -q "more than the model's vocabulary of 272" "$dir/refused.err" ||
    fail "a tokenizer too big for the model: exit $rc, $(cat "$dir/refused.err")"
fi
echo "$name: all checks passed"
