#!/usr/bin/env bash
# Multi-engine `fp4rollout rollout` on the CPU backend (docs/scheduler.md):
# mpirun -np 4 --tp 2 makes 2 engines that split the prompts; world rank 0
# prints every sample once, in request order, with one stats line.
#  - 64 prompts x 4 samples: 256 lines, each (request, sample) once, and the
#    tokens of the single-process run up to rounding (tp 2 sums in another
#    order; the bound is justified in check). The check uses --kv f32: with
#    BF16 KV the rounding of keys to BF16 magnifies the difference and more
#    samples drift;
#  - 2 engines of tp 1 in deterministic mode against one process: bitwise
#    the same tokens and log-probs (BF16 KV);
#  - 32 prompts with KV room for 8 sequences: all finish, preemptions > 0.
# Skipped, with a message, when mpirun is absent.
set -euo pipefail
name=rollout_mpi mpi_limit=120
source "$(dirname "$0")/mpi_setup.bash"

random_prompts "$dir/prompts.txt" 7 64
head -32 "$dir/prompts.txt" > "$dir/prompts32.txt"
args=(rollout --model synthetic:tiny --backend cpu --n 4 --max-tokens 40 --temperature 1 --seed 11 --json)

# check FILE PROMPTS [REF [bitwise]]: every (request, sample) once, in request
# order, ended by stop or length; with REF, the same tokens as that file;
# with bitwise, also the same log-probs (printed with 9 digits: bitwise);
# with close, arithmetic that genuinely differs (tp 2 against tp 1): see below.
check() {
  $py - "$@" <<'PY'
import json, sys
def load(path, n):
    rows = [json.loads(l) for l in open(path)]
    keys = [(r["request_id"], r["sample"]) for r in rows]
    assert len(rows) == n * 4, f"{path}: {len(rows)} lines, not {n * 4}"
    assert set(keys) == {(i, k) for i in range(n) for k in range(4)}, f"{path}: samples missing or repeated"
    assert keys == sorted(keys), f"{path}: not in request order"
    for r in rows:
        assert r["finish_reason"] in ("stop", "length"), r["finish_reason"]
        assert len(r["token_ids"]) == len(r["logprobs"]) >= 1
    return {k: (r["token_ids"], r["logprobs"]) if bitwise or close else r["token_ids"] for k, r in zip(keys, rows)}
n = int(sys.argv[2])
bitwise = len(sys.argv) > 4 and sys.argv[4] == "bitwise"
close = len(sys.argv) > 4 and sys.argv[4] == "close"
a = load(sys.argv[1], n)
if close:
    # tp 2 adds two partial sums where tp 1 sums once: float32 logits differ
    # by a few ulps (relative 1e-6), log-probs by far less than 1e-4. A token
    # changes only when a draw falls within that distance of a boundary of the
    # sampling CDF: about 1e-6 per token, so over the ~10k tokens here rarely
    # one sample, and 2 of 256 is a generous bound. Before the first differing
    # token the log-probs agree within 1e-4.
    b = {(r["request_id"], r["sample"]): (r["token_ids"], r["logprobs"]) for r in map(json.loads, open(sys.argv[3]))}
    same = 0
    for k, (ta, la) in a.items():
        tb, lb = b[k]
        same += ta == tb
        for i in range(min(len(ta), len(tb))):
            assert abs(la[i] - lb[i]) <= 1e-4, f"{k} token {i}: log-prob {la[i]} vs {lb[i]}"
            if ta[i] != tb[i]:
                break
    print(f"{same}/{len(a)} samples equal to the single-process run, the rest within tolerance")
    sys.exit(0 if same >= len(a) - 2 else 1)
if len(sys.argv) > 3:
    b = {(r["request_id"], r["sample"]): (r["token_ids"], r["logprobs"]) if bitwise else r["token_ids"]
         for r in map(json.loads, open(sys.argv[3]))}
    same = sum(a[k] == b.get(k) for k in a)
    print(f"{same}/{len(a)} samples equal to the single-process run")
    sys.exit(0 if same == len(a) else 1)
PY
}

# (a) 2 engines of tp 2 against one process, f32 KV.
"$bin" "${args[@]}" --prompts "$dir/prompts.txt" --kv f32 > "$dir/one.jsonl" 2> "$dir/one.err" ||
  fail "single-process run failed: $(cat "$dir/one.err")"
run_np 4 "${args[@]}" --tp 2 --prompts "$dir/prompts.txt" --kv f32 > "$dir/mpi.jsonl" 2> "$dir/mpi.err" ||
  fail "mpirun -np 4 --tp 2 failed: $(tail -5 "$dir/mpi.err")"
echo -n "np 4 tp 2, f32 KV: "; check "$dir/mpi.jsonl" 64 "$dir/one.jsonl" close || fail "tokens differ from one process"
[ "$(grep -c '^rollout: engines ' "$dir/mpi.err")" -eq 1 ] || fail "not exactly one stats line: $(cat "$dir/mpi.err")"
[ "$(grep -c ' rollout: seed 11$' "$dir/mpi.err")" -eq 1 ] || fail "not exactly one seed line: $(cat "$dir/mpi.err")"
grep -q "^rollout: engines 2 x tp 2 (world 4) requests 64 samples 256 " "$dir/mpi.err" ||
  fail "stats line: $(cat "$dir/mpi.err")"

# 2 engines of tp 1 (BF16 KV, the default): a different batch composition,
# bitwise the same samples in deterministic mode.
"$bin" "${args[@]}" --deterministic --prompts "$dir/prompts.txt" > "$dir/one16.jsonl" 2>/dev/null ||
  fail "single-process bf16 run"
run_np 2 "${args[@]}" --deterministic --prompts "$dir/prompts.txt" > "$dir/mpi16.jsonl" 2> "$dir/mpi16.err" ||
  fail "mpirun -np 2 failed: $(tail -5 "$dir/mpi16.err")"
echo -n "np 2 tp 1, bf16 KV, deterministic: "
check "$dir/mpi16.jsonl" 64 "$dir/one16.jsonl" bitwise || fail "samples differ from one process"
grep -q "^rollout: engines 2 x tp 1 (world 2) requests 64 samples 256 " "$dir/mpi16.err" ||
  fail "stats line: $(cat "$dir/mpi16.err")"

# (b) KV room for 8 sequences per engine: every sample ends, some preempted.
run_np 4 "${args[@]}" --tp 2 --prompts "$dir/prompts32.txt" --max-seqs 8 --kv-blocks 10 --chunk 64 \
  > "$dir/tight.jsonl" 2> "$dir/tight.err" || fail "capacity-limited run failed: $(tail -5 "$dir/tight.err")"
check "$dir/tight.jsonl" 32 || fail "capacity-limited run"
grep -q "^rollout: engines 2 x tp 2 (world 4) requests 32 samples 128 .* preemptions [1-9]" "$dir/tight.err" ||
  fail "no preemption reported: $(cat "$dir/tight.err")"
echo "capacity-limited: $(grep '^rollout: ' "$dir/tight.err")"

# More engines than prompts: the idle engines send totals only.
head -1 "$dir/prompts.txt" > "$dir/one_prompt.txt"
run_np 4 "${args[@]}" --tp 1 --prompts "$dir/one_prompt.txt" > "$dir/few.jsonl" 2> "$dir/few.err" ||
  fail "one prompt over 4 engines failed: $(tail -5 "$dir/few.err")"
check "$dir/few.jsonl" 1 || fail "one prompt over 4 engines"
grep -q "^rollout: engines 4 x tp 1 (world 4) requests 1 samples 4 " "$dir/few.err" ||
  fail "stats line: $(cat "$dir/few.err")"
echo "rollout_mpi: all checks passed"
