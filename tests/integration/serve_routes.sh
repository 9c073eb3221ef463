#!/usr/bin/env bash
# Routed-expert replay over loopback (docs/deepseek_moe.md, "Routed-expert
# replay"; docs/protocol.md, done) on the CPU MoE model synthetic:tiny-dsmoe
# with an f32 KV cache: the experts of a greedy sample through
# fp4rollout-client, the Python client (serve_routes.py: a continuation's
# own, stitched to the whole sample's) and HTTP's meta_info.routed_experts
# equal those `fp4rollout rollout --return-routed-experts` takes from the
# engine directly; a two-engine server carries the flag and the records
# across the ranks; a dense model refuses the request, naming it.
set -euo pipefail
name=serve_routes
source "$(dirname "$0")/serve_setup.bash"

model=synthetic:tiny-dsmoe
conf() { # MODEL -> a serve configuration (PORT and HPORT filled in later)
  echo "{\"model\": \"$1\", \"backend\": \"cpu\", \"kv_dtype\": \"f32\", \"max_seqs\": 8, \"metrics_port\": HPORT,
   \"http\": {\"max_body_bytes\": 65536}, \"sampling\": {\"max_tokens\": 16},
   \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
}
hport=$(free_port)
start_server s "$(conf $model | sed "s/HPORT/$hport/")"

printf '1,2,3,4,5\n9,8,7\n' > "$dir/p.txt"
opts=(--temperature 0 --seed 3 --max-tokens 8 --ignore-eos --return-routed-experts)
timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" "${opts[@]}" \
  > "$dir/c.jsonl" || fail "fp4rollout-client generate failed"
"$bin" rollout --model $model --backend cpu --kv f32 --prompts "$dir/p.txt" --greedy --max-tokens 8 --ignore-eos \
  --return-routed-experts --json > "$dir/r.jsonl" 2> "$dir/r.err" || fail "rollout failed: $(cat "$dir/r.err")"
curl -sf "http://127.0.0.1:$hport/generate" -d '{"input_ids": [1,2,3,4,5], "return_routed_experts": true,
  "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": true}}' > "$dir/h.json" ||
  fail "HTTP /generate failed"
timeout 120 $py "$(dirname "$0")/serve_routes.py" "$ep" "$dir/r.jsonl" ||
  fail "the Python client's checks failed"
$py - "$dir/c.jsonl" "$dir/r.jsonl" "$dir/h.json" <<'PY' || fail "the experts through serve differ from the engine's"
import base64, json, struct, sys
client = {x["request_id"]: x for x in map(json.loads, open(sys.argv[1]))}
engine = {x["request_id"]: x for x in map(json.loads, open(sys.argv[2]))}
assert set(client) == set(engine) == {0, 1}, (sorted(client), sorted(engine))
for r in (0, 1):
    c, e = client[r], engine[r]
    assert c["token_ids"] == e["token_ids"] and len(c["token_ids"]) == 8, (r, c["token_ids"], e["token_ids"])
    assert c["routed_experts"] == e["routed_experts"], (r, c["routed_experts"], e["routed_experts"])
    layers, k = len(e["routed_experts"][0]), len(e["routed_experts"][0][0])
    assert layers >= 1 and k >= 2 and all(len(t) == layers and all(len(m) == k for m in t)
                                          for t in e["routed_experts"]), e["routed_experts"]
    assert all(len(set(m)) == k for t in e["routed_experts"] for m in t), "an expert chosen twice in one layer"
h = json.load(open(sys.argv[3]))
meta = h["meta_info"]
n, layers, k = meta["routed_experts_shape"]
raw = base64.b64decode(meta["routed_experts"])
ids = struct.unpack("<%di" % (len(raw) // 4), raw)
assert len(ids) == n * layers * k, (len(ids), n, layers, k)
got = [[list(ids[(t * layers + m) * k:(t * layers + m + 1) * k]) for m in range(layers)] for t in range(n)]
assert h["output_ids"] == engine[0]["token_ids"], (h["output_ids"], engine[0]["token_ids"])
assert got == engine[0]["routed_experts"], (got, engine[0]["routed_experts"])
PY
grep -q routed_experts "$dir/c.jsonl" || fail "no routed_experts in fp4rollout-client's lines"
timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" --temperature 0 --max-tokens 4 \
  > "$dir/plain.jsonl" || fail "a generate without the flag failed"
grep -q routed_experts "$dir/plain.jsonl" && fail "routed experts sent unasked"

# Several ranks: the flag reaches the engines and the records come back.
if command -v mpirun >/dev/null 2>&1; then
  mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
  [ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
  start_server mpi "$(conf $model | sed "s/HPORT/$(free_port)/")" timeout 120 "${mpi[@]}" -np 2
  timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" "${opts[@]}" \
    > "$dir/m.jsonl" || fail "generate on two engines failed"
  # the tokens and experts, not the log-probs: batching changes their last bits ("Exactness", docs/scheduler.md)
  $py - "$dir/c.jsonl" "$dir/m.jsonl" <<'PY' || fail "a two-engine server's experts differ from one process's"
import json, sys
one, two = ({x["request_id"]: (x["token_ids"], x["routed_experts"]) for x in map(json.loads, open(p))}
            for p in sys.argv[1:3])
assert one == two and len(one) == 2, (one, two)
PY
fi

# A dense model refuses the request, naming it (invalid_request).
dport=$(free_port)
start_server dense "$(conf synthetic:tiny | sed "s/HPORT/$dport/")"
set +e
timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" --first-id 7 "${opts[@]}" \
  > /dev/null 2> "$dir/dense.err"
rc=$?
set -e
[ $rc -ne 0 ] || fail "a dense model accepted return_routed_experts"
grep -q "request 7: invalid_request: request 7: return_routed_experts: the model has no mixture-of-experts layer" \
  "$dir/dense.err" || fail "the dense model's refusal: $(cat "$dir/dense.err")"
code=$(curl -s -o "$dir/dh.json" -w '%{http_code}' "http://127.0.0.1:$dport/generate" \
  -d '{"input_ids": [1,2,3], "return_routed_experts": true, "sampling_params": {"max_new_tokens": 2}}')
[ "$code" = 400 ] && grep -q "the model has no mixture-of-experts layer" "$dir/dh.json" ||
  fail "HTTP on a dense model: $code $(cat "$dir/dh.json")"
# OpenAI's completions ignore it (docs/http.md)
curl -sf "http://127.0.0.1:$dport/v1/completions" -d '{"prompt": [1,2,3], "max_tokens": 2,
  "return_routed_experts": true}' | grep -q '"choices"' || fail "/v1/completions with return_routed_experts"
echo "serve_routes: ok"
