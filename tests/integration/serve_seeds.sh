#!/usr/bin/env bash
# Sampling seeds (docs/sampling.md, "Seeds") over loopback on the built-in
# synthetic model: unseeded requests for the same prompt get fresh seeds and
# differ; every sample reports its seed, in the Python client, the C client
# (fp4rollout-client) and the CLI's JSON; a reported seed replays its
# sample bitwise (alone in the batch both times), through the server and
# through `fp4rollout rollout`; a configured `sampling.seed` makes a server's
# stream of seeds, and so its samples, reproducible; unseeded CLI runs differ;
# one sample of a request replays alone from its seed and index
# (first_sample), through the server, rollout and generate, and in
# deterministic mode with a BF16 cache even when it was drawn in a busy batch;
# under mpirun, a seed replays on either of two engines and a two-engine
# rollout samples with rank 0's seed.
set -euo pipefail
name=serve_seeds
source "$(dirname "$0")/serve_setup.bash"

conf='{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16,
 "coordinator": {"bind": "127.0.0.1", "port": PORT}SAMPLING}'
start_server os "${conf/SAMPLING/}"; os_ep=$ep
start_server a "${conf/SAMPLING/, \"sampling\": {\"seed\": 77}}"; a_ep=$ep
start_server b "${conf/SAMPLING/, \"sampling\": {\"seed\": 77}}"; b_ep=$ep
det='{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "bf16", "max_seqs": 16, "deterministic": true,
 "coordinator": {"bind": "127.0.0.1", "port": PORT}}'
start_server det "$det"; det_ep=$ep

oseed=$(BUILD="$build" timeout 120 $py "$(dirname "$0")/serve_seeds.py" "$os_ep" "$a_ep" "$b_ep" 77 "$det_ep") ||
  fail "the Python client's seed checks failed"

# The C client prints each done's seed; a reported seed replays the request.
c() { timeout 60 "$cli" --endpoint "$os_ep" --timeout-ms 20000 "$@"; }
echo "256,104,101,108,108,111" > "$dir/p1.txt"
gen=(generate --prompts "$dir/p1.txt" --n 2 --max-tokens 24 --temperature 1 --ignore-eos)
c "${gen[@]}" > "$dir/c1.jsonl" || fail "generate failed"
c "${gen[@]}" > "$dir/c2.jsonl" || fail "generate failed"
s1=$($py -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["seed"])' "$dir/c1.jsonl") ||
  fail "the C client printed no seed: $(head -c 300 "$dir/c1.jsonl")"
c "${gen[@]}" --seed "$s1" > "$dir/c3.jsonl" || fail "generate with the reported seed failed"
$py - "$dir/c1.jsonl" "$dir/c2.jsonl" "$dir/c3.jsonl" <<'PY' || fail "the C client's seeds"
import json, sys
a, b, r = ({x["sample"]: x for x in map(json.loads, open(p))} for p in sys.argv[1:4])
assert set(a) == set(b) == set(r) == {0, 1}
assert a[0]["seed"] == a[1]["seed"] and b[0]["seed"] == b[1]["seed"] and a[0]["seed"] != b[0]["seed"]
assert a[0]["token_ids"] != b[0]["token_ids"], "two unseeded generates gave the same tokens"
for k in (0, 1):
    assert r[k]["seed"] == a[k]["seed"]
    assert (r[k]["token_ids"], r[k]["logprobs"]) == (a[k]["token_ids"], a[k]["logprobs"]), f"sample {k} did not replay"
PY

# The CLI: unseeded runs draw fresh seeds (printed on stderr and in the
# JSON), and a seed the server reported replays through `rollout` (f32 KV:
# the server's samples are rollout's, docs/protocol.md).
roll=(rollout --model synthetic:tiny --backend cpu --kv f32 --max-seqs 16 --prompts "$dir/p1.txt" --n 2
      --max-tokens 24 --temperature 1 --ignore-eos --json)
"$bin" "${roll[@]}" > "$dir/r1.jsonl" 2> "$dir/r1.err" || fail "rollout failed"
"$bin" "${roll[@]}" > "$dir/r2.jsonl" 2> "$dir/r2.err" || fail "rollout failed"
"$bin" "${roll[@]}" --seed "$s1" > "$dir/r3.jsonl" 2> /dev/null || fail "rollout with a seed failed"
$py - "$dir/r1.jsonl" "$dir/r2.jsonl" "$dir/r3.jsonl" "$dir/c1.jsonl" "$dir/r1.err" <<'PY' ||
import json, re, sys
r1, r2, r3, c1 = ({x["sample"]: x for x in map(json.loads, open(p))} for p in sys.argv[1:5])
printed = re.search(r" rollout: seed (\d+)$", open(sys.argv[5]).read(), re.M)
assert printed and int(printed.group(1)) == r1[0]["seed"] == r1[1]["seed"], "the seed printed on stderr"
assert r1[0]["seed"] != r2[0]["seed"] and r1[0]["token_ids"] != r2[0]["token_ids"], "two unseeded rollouts are equal"
for k in (0, 1):
    assert r3[k]["seed"] == c1[k]["seed"]
    assert (r3[k]["token_ids"], r3[k]["logprobs"]) == (c1[k]["token_ids"], c1[k]["logprobs"]), f"sample {k}"
PY
  fail "rollout's seeds"
# One sample of a request alone, from its seed and index (--first-sample I
# --n 1): bitwise in deterministic mode, where the batch it ran in does not
# matter; through the C client and the server, and through rollout.
d() { timeout 60 "$cli" --endpoint "$det_ep" --timeout-ms 20000 "$@"; }
d "${gen[@]}" > "$dir/d1.jsonl" || fail "generate failed"
ds=$($py -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["seed"])' "$dir/d1.jsonl")
d "${gen[@]}" --seed "$ds" --first-sample 1 --n 1 > "$dir/d2.jsonl" || fail "generate --first-sample failed"
droll=("${roll[@]/f32/bf16}" --deterministic --seed "$ds" --first-sample 1 --n 1)
"$bin" "${droll[@]}" > "$dir/d3.jsonl" 2> /dev/null || fail "rollout --first-sample failed"
$py - "$dir/d1.jsonl" "$dir/d2.jsonl" "$dir/d3.jsonl" <<'PY' || fail "one sample did not replay alone"
import json, sys
a, one, roll = ({x["sample"]: x for x in map(json.loads, open(p))} for p in sys.argv[1:4])
for got in (one, roll):
    assert set(got) == {1} and got[1]["seed"] == a[1]["seed"], "--first-sample 1 --n 1 reports another sample"
    assert (got[1]["token_ids"], got[1]["logprobs"]) == (a[1]["token_ids"], a[1]["logprobs"]), "sample 1 alone"
PY
# generate: the same, and a seed it printed replays it.
g=(generate --model synthetic:tiny --backend cpu --kv f32 --max-tokens 16 --temperature 1 --json)
"$bin" "${g[@]}" > "$dir/g1.jsonl" 2> /dev/null || fail "generate failed"
"$bin" "${g[@]}" > "$dir/g2.jsonl" 2> /dev/null || fail "generate failed"
gs=$($py -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["seed"])' "$dir/g1.jsonl")
"$bin" "${g[@]}" --seed "$gs" > "$dir/g3.jsonl" 2> /dev/null || fail "generate with its seed failed"
cmp -s "$dir/g1.jsonl" "$dir/g3.jsonl" || fail "generate did not replay from its printed seed"
cmp -s "$dir/g1.jsonl" "$dir/g2.jsonl" && fail "two unseeded generates printed the same samples"
# generate, deterministic: sample 2 of three replays alone from its seed and index.
"$bin" "${g[@]}" --deterministic --kv bf16 --n 3 --seed "$gs" > "$dir/g4.jsonl" 2> /dev/null || fail "generate --n 3"
"$bin" "${g[@]}" --deterministic --kv bf16 --seed "$gs" --first-sample 2 > "$dir/g5.jsonl" 2> /dev/null ||
  fail "generate --first-sample failed"
[ "$(sed -n 3p "$dir/g4.jsonl")" = "$(cat "$dir/g5.jsonl")" ] || fail "generate's sample 2 did not replay alone"
grep -q '"sample":2,' "$dir/g5.jsonl" || fail "generate --first-sample 2 did not report sample 2"
[ -n "$oseed" ] || fail "no seed came back"

# Several ranks. Two engines behind rank 0: the seed rank 0 assigned an
# unseeded request replays it on either engine (routing alternates between
# idle engines). A two-engine rollout without --seed: both engines sample
# with rank 0's seed, so one process given that seed prints the same.
if command -v mpirun >/dev/null 2>&1; then
  mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
  [ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
  start_server mpi "${conf/SAMPLING/}" timeout 120 "${mpi[@]}" -np 2
  grep -q "engines 2" "$dir/mpi.log" || fail "the two-engine server did not start two engines"
  mpi_ep=$ep
  m() { timeout 60 "$cli" --endpoint "$mpi_ep" --timeout-ms 20000 "$@"; }
  m "${gen[@]}" > "$dir/m1.jsonl" || fail "generate on two engines failed"
  ms=$($py -c 'import json, sys; print(json.loads(open(sys.argv[1]).readline())["seed"])' "$dir/m1.jsonl")
  m "${gen[@]}" --seed "$ms" > "$dir/m2.jsonl" || fail "replay on two engines failed"
  m "${gen[@]}" --seed "$ms" > "$dir/m3.jsonl" || fail "replay on two engines failed"
  $py - "$dir/m1.jsonl" "$dir/m2.jsonl" "$dir/m3.jsonl" <<'PY' || fail "a seed did not replay across engines"
import json, sys
a, b, c = ({x["sample"]: x for x in map(json.loads, open(p))} for p in sys.argv[1:4])
for k in (0, 1):
    assert a[k]["seed"] == b[k]["seed"] == c[k]["seed"]
    assert (a[k]["token_ids"], a[k]["logprobs"]) == (b[k]["token_ids"], b[k]["logprobs"]) == (c[k]["token_ids"], c[k]["logprobs"])
PY
  printf '256,104,101,108,108,111\n256,7,8,9\n' > "$dir/p2.txt"
  roll2=(rollout --model synthetic:tiny --backend cpu --kv f32 --max-seqs 16 --prompts "$dir/p2.txt" --n 2
         --max-tokens 24 --temperature 1 --ignore-eos --json)
  timeout 120 "${mpi[@]}" -np 2 "$bin" "${roll2[@]}" > "$dir/mr.jsonl" 2> "$dir/mr.err" ||
    fail "a two-engine rollout failed: $(tail -5 "$dir/mr.err")"
  rs=$(sed -n 's/^.* rollout: seed \([0-9]*\)$/\1/p' "$dir/mr.err")
  [ -n "$rs" ] || fail "the two-engine rollout printed no seed"
  "$bin" "${roll2[@]}" --seed "$rs" > "$dir/sr.jsonl" 2> /dev/null || fail "rollout with the seed failed"
  # Tokens and seeds only: one process batches both prompts where each
  # engine ran one alone, so log-probs may differ in their last bits
  # (docs/scheduler.md, "Exactness"); a seed of its own on either engine
  # would change every token.
  $py - "$dir/mr.jsonl" "$dir/sr.jsonl" "$rs" <<'PY' || fail "the two-engine rollout's engines did not share rank 0's seed"
import json, sys
a, b = ({(x["request_id"], x["sample"]): x for x in map(json.loads, open(p))} for p in sys.argv[1:3])
assert set(a) == set(b) == {(r, k) for r in (0, 1) for k in (0, 1)}
for key in a:
    assert a[key]["seed"] == b[key]["seed"] == int(sys.argv[3]), key
    assert a[key]["token_ids"] == b[key]["token_ids"], key
PY
fi
echo "serve_seeds: ok"
