#!/usr/bin/env bash
# The calls an RL trainer makes (docs/protocol.md; the clients' READMEs)
# against `fp4rollout serve` on synthetic:tiny, deterministic with an f32
# KV cache: 64 concurrent asyncio calls of mixed n and threads on one
# blocking client each get exactly their own samples, equal to the prompt
# run alone; abort of some requests, of all, and pause("abort") deliver
# every sample they end once with what it made (tokens, log-probs, weight
# versions, top log-probs); a call past its deadline aborts its requests
# and leaks nothing into the next; a sample as long as the window allows
# needs no time limit; bad stop ids and max_tokens beyond the window are
# refused naming the request (serve_calls.py). fp4rollout-client prints
# the samples its abort ended, and refuses the same bad input.
set -euo pipefail
name=serve_calls
source "$(dirname "$0")/serve_setup.bash"

start_server s '{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16, "deterministic": true,
 "coordinator": {"bind": "127.0.0.1", "port": PORT}}'
timeout 300 $py "$(dirname "$0")/serve_calls.py" "$ep" || fail "the Python client's checks failed"

# fp4rollout-client: its only request aborted once tokens came; every
# sample is printed once, with reason abort and the tokens it made.
c() { timeout 120 "$cli" --endpoint "$ep" "$@"; }
echo "256,1,2,3" > "$dir/p.txt"
c generate --prompts "$dir/p.txt" --first-id 5 --n 2 --max-tokens 3000 --ignore-eos --temperature 1 \
  --abort-id 5 --abort-after 4 > "$dir/abort.jsonl" 2> "$dir/abort.err" ||
  fail "generate with --abort-id failed: $(cat "$dir/abort.err")"
$py - "$dir/abort.jsonl" <<'PY' || fail "fp4rollout-client's aborted samples: $(head -c 400 "$dir/abort.jsonl")"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert sorted((r["request_id"], r["sample"]) for r in rows) == [(5, 0), (5, 1)], rows
for r in rows:
    assert r["finish_reason"] == "abort" and 1 <= len(r["token_ids"]) < 3000 and len(r["logprobs"]) == len(r["token_ids"])
PY
# Bad input: refused, naming the request; nothing printed as a sample.
if c generate --prompts "$dir/p.txt" --first-id 9 --stop-ids 272 --max-tokens 4 > "$dir/bad.jsonl" 2> "$dir/bad.err"; then
  fail "a stop id equal to the vocabulary size was accepted"
fi
grep -q "invalid_request" "$dir/bad.err" && grep -q "request 9" "$dir/bad.err" ||
  fail "the refusal does not name the request: $(cat "$dir/bad.err")"
if c generate --prompts "$dir/p.txt" --first-id 10 --max-tokens 4093 > "$dir/bad2.jsonl" 2> "$dir/bad2.err"; then
  fail "max_tokens beyond the window was accepted"
fi
grep -q "request 10: max_tokens 4093 does not fit the context window" "$dir/bad2.err" ||
  fail "the max_tokens refusal: $(cat "$dir/bad2.err")"
[ -s "$dir/bad.jsonl" ] || [ -s "$dir/bad2.jsonl" ] && fail "a refused request printed a sample"
echo "serve_calls: ok"
