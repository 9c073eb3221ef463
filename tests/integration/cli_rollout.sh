#!/usr/bin/env bash
# Black-box checks of `fp4rollout rollout` on the built-in synthetic model:
# 64 prompts x 4 samples, every sample reported exactly once, and a
# capacity-limited run that preempts, with other prefill chunks, yet yields
# bitwise the same tokens and log-probs in deterministic mode (f32 KV).
set -euo pipefail
name=cli_rollout
source "$(dirname "$0")/cli_setup.bash"

random_prompts "$dir/prompts.txt" 5 64
run() { "$bin" rollout --model synthetic:tiny --backend cpu --prompts "$dir/prompts.txt" --n 4 \
          --max-tokens 40 --temperature 1 --seed 11 --kv f32 --deterministic --json "$@"; }
run > "$dir/ample.jsonl" 2> "$dir/ample.err" || fail "ample run failed: $(cat "$dir/ample.err")"
run --max-seqs 8 --kv-blocks 10 --chunk 64 > "$dir/tight.jsonl" 2> "$dir/tight.err" ||
  fail "capacity-limited run failed: $(cat "$dir/tight.err")"
grep -q "preemptions [1-9]" "$dir/tight.err" || fail "no preemption reported: $(cat "$dir/tight.err")"
# n = 4 on an engine of 3 sequences: each request's samples queue, 3 then 1.
run --max-seqs 3 > "$dir/split.jsonl" 2> "$dir/split.err" || fail "n > max-seqs run failed: $(cat "$dir/split.err")"
grep -q "samples 256 " "$dir/tight.err" || fail "stats line: $(cat "$dir/tight.err")"
$py - "$dir/ample.jsonl" "$dir/tight.jsonl" "$dir/split.jsonl" <<'PY' || fail "samples missing, repeated or different"
import json, math, sys
def load(path):
    rows = [json.loads(l) for l in open(path)]
    keys = [(r["request_id"], r["sample"]) for r in rows]
    assert len(keys) == len(set(keys)) == 256, "each sample exactly once"
    assert set(keys) == {(i, k) for i in range(64) for k in range(4)}
    for r in rows:
        assert len(r["token_ids"]) == len(r["logprobs"]) >= 1
        assert r["finish_reason"] in ("stop", "length")
        assert r["finish_reason"] == "stop" or len(r["token_ids"]) == 40
        assert all(lp <= 0 and math.isfinite(lp) for lp in r["logprobs"])
    return {k: r for k, r in zip(keys, rows)}
a, b, c = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
# Bitwise: the JSON log-probs have 9 significant digits, which round-trip a float.
same = sum(a[k]["token_ids"] == b[k]["token_ids"] and a[k]["logprobs"] == b[k]["logprobs"] for k in a)
assert same == 256, f"{256 - same} samples differ after preemption"
same = sum(a[k]["token_ids"] == c[k]["token_ids"] and a[k]["logprobs"] == c[k]["logprobs"] for k in a)
assert same == 256, f"{256 - same} samples differ when n exceeds max-seqs"
PY

expect_error() {
  local pattern=$1; shift
  if "$bin" "$@" >/dev/null 2>"$dir/err"; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
printf '256,1,2\n256,999\n' > "$dir/bad.txt"
expect_error "--prompts is required" rollout
expect_error "cannot read" rollout --prompts "$dir/none.txt"
expect_error "outside the vocabulary" rollout --backend cpu --prompts "$dir/bad.txt"
expect_error "KV blocks" rollout --backend cpu --prompts "$dir/prompts.txt" --max-tokens 500 --kv-blocks 2
{ out=$("$bin" rollout --help) && grep -q "usage: fp4rollout rollout" <<< "$out"; } || fail "rollout --help"
echo "cli_rollout: all checks passed"
