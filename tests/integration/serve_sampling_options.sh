#!/usr/bin/env bash
# min_tokens, top log-probs and prompt log-probs (docs/sampling.md) over
# loopback on the built-in synthetic model with an f32 KV cache: through
# the Python client (serve_sampling_options.py), fp4rollout-client's JSON,
# and `fp4rollout rollout` and `generate`, whose samples, top log-probs and
# prompt log-probs for the same seed equal the server's; bad values are
# refused with a clear message (exit 2 on the command line); the Python
# client streams tokens (generate_stream, stream_tokens). Under mpirun, a
# two-engine server and a two-engine deterministic rollout carry the options
# across the ranks and give the single process's numbers.
set -euo pipefail
name=serve_sampling_options
source "$(dirname "$0")/serve_setup.bash"

start_server s '{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16,
 "sampling": {"max_tokens": 16}, "coordinator": {"bind": "127.0.0.1", "port": PORT}}'
timeout 120 $py "$(dirname "$0")/serve_sampling_options.py" "$ep" "$dir/py.json" ||
  fail "the Python client's checks failed"

# The same request through fp4rollout-client, rollout and generate.
echo "256,104,101,108,108,111,32,119" > "$dir/p.txt"
opts=(--n 3 --temperature 0.8 --max-tokens 8 --ignore-eos --seed 5 --prompt-logprobs --logprobs 2 --min-tokens 3)
timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" "${opts[@]}" > "$dir/c.jsonl" ||
  fail "fp4rollout-client generate failed"
"$bin" rollout --model synthetic:tiny --backend cpu --kv f32 --prompts "$dir/p.txt" "${opts[@]}" --json \
  > "$dir/r.jsonl" 2> "$dir/r.err" || fail "rollout failed: $(cat "$dir/r.err")"
"$bin" generate --model synthetic:tiny --backend cpu --kv f32 --prompt-ids "$(cat "$dir/p.txt")" "${opts[@]}" --json \
  > "$dir/g.jsonl" 2> "$dir/g.err" || fail "generate failed: $(cat "$dir/g.err")"
$py - "$dir/py.json" "$dir/c.jsonl" "$dir/r.jsonl" "$dir/g.jsonl" <<'PY' || fail "the clients and commands disagree"
import json, struct, sys
def f32(x):   # the JSON prints floats to 9 digits: compare them as the float32 they are
    return None if x is None else struct.unpack("f", struct.pack("f", x))[0]
def norm(s):
    return (s["token_ids"], [f32(x) for x in s["logprobs"]],
            [[(t, f32(lp)) for t, lp in pairs] for pairs in s["top_logprobs"]],
            [f32(x) for x in s["prompt_logprobs"]] if s.get("prompt_logprobs") is not None else None)
py = {s["sample"]: s for s in json.load(open(sys.argv[1]))}
runs = [{x["sample"]: x for x in map(json.loads, open(p))} for p in sys.argv[2:5]]
for name, run in zip(("fp4rollout-client", "rollout", "generate"), runs):
    assert set(run) == {0, 1, 2}, (name, sorted(run))
    for k in range(3):
        assert ("prompt_logprobs" in run[k]) == (k == 0), (name, k, "prompt_logprobs only with sample 0")
        assert norm(py[k]) == norm(run[k]), (name, k, norm(py[k]), norm(run[k]))
PY

# Several ranks: the results travel from the engines to rank 0 with their
# top and prompt log-probs.
if command -v mpirun >/dev/null 2>&1; then
  mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
  [ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
  start_server mpi '{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16,
   "sampling": {"max_tokens": 16}, "coordinator": {"bind": "127.0.0.1", "port": PORT}}' timeout 120 "${mpi[@]}" -np 2
  timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" "${opts[@]}" > "$dir/m.jsonl" ||
    fail "generate on two engines failed"
  cmp -s <(sort "$dir/c.jsonl" | sed 's/"ttft_ms":[^,]*,"total_ms":[^,]*,//') \
         <(sort "$dir/m.jsonl" | sed 's/"ttft_ms":[^,]*,"total_ms":[^,]*,//') ||
    fail "a two-engine server's samples differ from one process's"
  printf '256,104,101,108,108,111\n256,7,8,9,10\n' > "$dir/p2.txt"
  det=(rollout --model synthetic:tiny --backend cpu --kv bf16 --deterministic --prompts "$dir/p2.txt" --json "${opts[@]}")
  timeout 120 "${mpi[@]}" -np 2 "$bin" "${det[@]}" > "$dir/mr.jsonl" 2> "$dir/mr.err" ||
    fail "a two-engine rollout failed: $(tail -3 "$dir/mr.err")"
  "$bin" "${det[@]}" > "$dir/sr.jsonl" 2> /dev/null || fail "rollout failed"
  cmp -s <(sort "$dir/mr.jsonl") <(sort "$dir/sr.jsonl") || fail "a two-engine rollout differs from one process"
  grep -c prompt_logprobs "$dir/mr.jsonl" | grep -qx 2 || fail "two prompts, two samples with prompt log-probs"
fi

# Bad values on the command line: exit 2 with the reason.
expect_usage() {
  local pattern=$1; shift
  set +e; "$@" > /dev/null 2> "$dir/err"; rc=$?; set -e
  [ $rc -eq 2 ] || fail "exit $rc, not 2, for: $*"
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
expect_usage "--logprobs expects" "$bin" generate --model synthetic:tiny --logprobs 21
expect_usage "--min-tokens 9 exceeds --max-tokens 8" "$bin" rollout --prompts "$dir/p.txt" --min-tokens 9 --max-tokens 8
expect_usage "--min-tokens expects" "$bin" generate --model synthetic:tiny --min-tokens -1
expect_usage "--logprobs expects" "$cli" --endpoint "$ep" generate --prompts "$dir/p.txt" --logprobs 21
echo "serve_sampling_options: ok"
