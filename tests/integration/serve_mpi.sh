#!/usr/bin/env bash
# `fp4rollout serve` under mpirun (docs/protocol.md, "Serving on several
# ranks") on synthetic:tiny with f32 KV in deterministic mode, against
# single-process servers:
# one engine of tp 2 serves 32 prompts x 4 samples to the C client and the
# Python client with every sample done once and the single process's tokens;
# a mid-stream weight update to synthetic:tiny:7 commits on both ranks
# (later tokens carry version 2, greedy outputs equal a fresh
# synthetic:tiny:7 server's); a refused update (bad checksum) leaves version
# 2 serving; a pause in keep mode freezes both ranks across an update (every
# sample's versions switch where it stopped; recomputed at resume, its
# tokens after the switch equal a continuation on the new weights,
# serve_pause_ranks.py); SIGTERM ends everything with a done per open sample
# and exit 0.
# Then two engines of tp 1: the same 32 x 4 bitwise (tokens and log-probs:
# deterministic mode makes them independent of which engine ran a sample and
# of what else it batched), an update both engines take, a keep pause that
# freezes both engines across another update (recomputed at the pause), a
# SIGTERM to one rank only. A rank that cannot start (the port is taken)
# makes every rank exit non-zero.
set -euo pipefail
name=serve_mpi
if ! command -v mpirun >/dev/null 2>&1; then
  echo "$name: SKIP: mpirun not found (install openmpi-bin: scripts/install-deps.sh)"
  exit 0
fi
source "$(dirname "$0")/serve_setup.bash"
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
$py -c 'import numpy' 2>/dev/null || fail "python3-numpy is missing (scripts/install-deps.sh)"
mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)

wait_listening() { # LOG PID
  for _ in $(seq 600); do
    grep -q "listening on" "$1" 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || fail "server $(basename "$1" .log) exited at start"
    sleep 0.05
  done
  fail "server $(basename "$1" .log) did not start"
}
config() { # NAME MODEL TP PORT
  echo "{\"model\": \"$2\", \"backend\": \"cpu\", \"kv_dtype\": \"f32\", \"max_seqs\": 32, \"tp\": $3,
 \"deterministic\": true, \"log_stats_interval_s\": 0.2,
 \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": $4}}" > "$dir/$1.json"
}
start_one() { # NAME MODEL -> endpoint in $ep
  local port; port=$(free_port)
  config "$1" "$2" 1 "$port"
  "$bin" serve --config "$dir/$1.json" 2> "$dir/$1.log" &
  pids+=($!)
  wait_listening "$dir/$1.log" $!
  ep=tcp://127.0.0.1:$port
}
start_mpi() { # NAME NP TP -> endpoint in $ep, mpirun's pid in $mpi_pid
  local port; port=$(free_port)
  config "$1" synthetic:tiny "$3" "$port"
  timeout 120 "${mpi[@]}" -np "$2" "$bin" serve --config "$dir/$1.json" 2> "$dir/$1.log" &
  mpi_pid=$!
  pids+=($mpi_pid)
  jobs_started+=($mpi_pid)
  wait_listening "$dir/$1.log" $mpi_pid
  ep=tcp://127.0.0.1:$port
}
# The ranks of a job: the fp4rollout processes under its mpirun.
ranks_of() {
  local p
  for p in $(descendants "$1"); do
    [ "$(cat "/proc/$p/comm" 2>/dev/null)" = fp4rollout ] && echo "$p"
  done
  return 0
}
# At exit (a failed check included), every process under each job started
# here goes too: killing `timeout` alone would leave mpirun and its ranks.
jobs_started=()
descendants() {
  local p kids; kids=($(pgrep -P "$1" || true))
  for p in "${kids[@]}"; do echo "$p"; descendants "$p"; done
  return 0
}
end_jobs() {
  local j
  for j in "${jobs_started[@]}"; do kill -KILL $(descendants "$j") 2>/dev/null || true; done
  cleanup
}
trap end_jobs EXIT
c() { local e=$1; shift; timeout 60 "$cli" --endpoint "$e" --timeout-ms 30000 "$@"; }
gen() { # ENDPOINT SEED OUT
  c "$1" generate --prompts "$dir/p32.txt" --n 4 --max-tokens 32 --temperature 1 --seed "$2" > "$3" ||
    fail "generate on $1"
}
# Every (request, sample) once, the reference's tokens and finish reasons,
# log-probs within TOL: 0 (bitwise; the client prints 9 digits) where only
# the batching differs, 1e-4 for tp 2, which adds two partial sums where
# tp 1 sums once: its float32 logits differ by a few ulps, its log-probs by
# orders of magnitude less than 1e-4.
same_as() { # GOT REF TOL
  $py - "$1" "$2" "$3" <<'PY' || fail "$1 differs from $2"
import json, sys
got = [json.loads(l) for l in open(sys.argv[1])]
ref = {(r["request_id"], r["sample"]): r for r in map(json.loads, open(sys.argv[2]))}
tol = float(sys.argv[3])
keys = [(r["request_id"], r["sample"]) for r in got]
assert len(keys) == len(set(keys)) == len(ref) == 128, f"{len(keys)} samples, {len(set(keys))} distinct"
differ = 0
for r in got:
    e = ref[(r["request_id"], r["sample"])]
    for i, (a, b) in enumerate(zip(r["logprobs"], e["logprobs"])):
        assert abs(a - b) <= tol, (r["request_id"], r["sample"], i)
        if r["token_ids"][i] != e["token_ids"][i]:
            break
    if r["token_ids"] != e["token_ids"] or r["finish_reason"] != e["finish_reason"]:
        differ += 1
# tol 0: every sample the same. tol > 0 (tp 2): a token changes only where a
# draw falls within the rounding difference of a boundary of the sampling
# CDF, about 1e-6 per token over ~4k tokens here, so rarely one sample; 2 of
# 128 is a generous bound.
assert differ <= (2 if tol > 0 else 0), f"{differ} samples differ"
PY
}
hello_check() { # ENDPOINT TP ENGINES
  c "$1" hello | $py -c "import json,sys; d=json.load(sys.stdin); sys.exit(0 if d['tp']==$2 and d['engines']==$3 else 1)" ||
    fail "hello on $1 does not report tp $2 and $3 engines"
}
# Ends the job with SIGTERM to RANKS (pids), waits for mpirun: exit 0
# within 30 s, or fail.
stop_job() { # LOG RANK-PIDS...
  local log=$1; shift
  kill -TERM "$@"
  for _ in $(seq 600); do kill -0 "$mpi_pid" 2>/dev/null || break; sleep 0.05; done
  kill -0 "$mpi_pid" 2>/dev/null && fail "the job did not end within 30 s of SIGTERM"
  local rc=0; wait "$mpi_pid" || rc=$?
  [ $rc -eq 0 ] || fail "mpirun exited $rc after SIGTERM"
  grep -q "shutting down" "$log" && grep -q "serve: stopped" "$log" || fail "no clean shutdown in $log"
}

$py - "$dir" <<'PY'
import random, sys
random.seed(31)
with open(f"{sys.argv[1]}/p32.txt", "w") as f:
    for _ in range(32):
        f.write(",".join(["256"] + [str(random.randint(0, 255)) for _ in range(random.randint(2, 40))]) + "\n")
PY
start_one ref synthetic:tiny; ref_ep=$ep
start_one fresh7 synthetic:tiny:7; fresh_ep=$ep
$cli push-weights --model synthetic:tiny:7 --export "$dir/w7.bin" > "$dir/w7.jsonl" || fail "export"
gen "$ref_ep" 11 "$dir/ref11.jsonl"

# --- one engine of tp 2 -------------------------------------------------------
start_mpi tp2 2 2; tp2_ep=$ep; tp2_job=$mpi_pid
hello_check "$tp2_ep" 2 1
gen "$tp2_ep" 11 "$dir/tp2_11.jsonl"
same_as "$dir/tp2_11.jsonl" "$dir/ref11.jsonl" 1e-4

BUILD="$build" timeout 120 $py - "$tp2_ep" "$ref_ep" "$fresh_ep" "$dir/w7.bin" "$dir/w7.jsonl" <<'PY' || fail "the Python checks failed"
import json, os, random, sys
sys.path.insert(0, os.path.join(os.getcwd(), "trainer_bridge", "client", "python"))
import numpy as np
from fp4rollout_client import RolloutClient, ServerError, load_exported

def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_mpi: {what}")

def greedy(c, prompts):
    out = {}
    for s in c.generate(prompts, n=1, temperature=0, max_tokens=16, stop_token_ids=[]):
        out[s.request_id] = s.token_ids
    return [out[k] for k in sorted(out)]

tp2_ep, ref_ep, fresh_ep, wbin, windex = sys.argv[1:6]
weights = load_exported(wbin, windex)
random.seed(5)
prompts = [[256] + [random.randint(0, 255) for _ in range(random.randint(2, 30))] for _ in range(32)]
probe = prompts[:4]

def run(c):
    for i, p in enumerate(prompts):
        c.submit(p, n=4, temperature=1.0, seed=21, max_tokens=24, request_id=1000 + i)
    return {(s.request_id, s.sample): s for s in c.results()}

with RolloutClient(ref_ep, timeout_ms=60000) as r:
    want = run(r)
    want0 = greedy(r, probe)
with RolloutClient(fresh_ep, timeout_ms=60000) as f:
    want7 = greedy(f, probe)
check(want0 != want7, "synthetic:tiny and synthetic:tiny:7 give the same greedy tokens")

with RolloutClient(tp2_ep, timeout_ms=60000) as c:
    got = run(c)
    check(len(got) == 128 and got.keys() == want.keys(), f"{len(got)} samples")
    # tp 2 against tp 1 rounds differently: at most 2 samples of 128 may take
    # another token (the bound is argued in same_as).
    differ = sum(s.token_ids != want[k].token_ids or s.finish_reason != want[k].finish_reason for k, s in got.items())
    check(differ <= 2, f"{differ} samples differ from the single process's")
    for k, s in got.items():
        check(set(s.weight_versions) == {0}, f"versions {s.weight_versions}")
    check(greedy(c, probe) == want0, "greedy outputs before the update")

    # 32 x 4 with the update to synthetic:tiny:7 (version 2) committed once
    # the first sample is done, while the rest stream.
    for i, p in enumerate(prompts):
        c.submit(p, n=4, temperature=1.0, seed=22, max_tokens=48, stop_token_ids=[], request_id=2000 + i)
    seen, commit = [], None
    for s in c.results():
        seen.append(s)
        if commit is None:
            commit = c.update_weights(weights, version=2, bucket_bytes=256 << 10)
    check(commit["weight_version"] == 2 and commit["bytes"] == sum(w.nbytes for w in weights.values()), f"commit reply {commit}")
    keys = [(s.request_id, s.sample) for s in seen]
    check(len(keys) == 128 and len(set(keys)) == 128, f"{len(keys)} dones, want 128 distinct")
    v2 = 0
    for s in seen:
        check(len(s.token_ids) == 48 and s.finish_reason == "length", f"sample {s.request_id}/{s.sample}")
        check(len(s.weight_versions) == 48 and s.weight_versions == sorted(s.weight_versions) and
              set(s.weight_versions) <= {0, 2}, f"versions {s.weight_versions}")
        v2 += s.weight_versions[-1] == 2
    check(v2 > 0, "no token was drawn with version 2 after the commit")
    check(greedy(c, probe) == want7, "greedy outputs after the update differ from a fresh synthetic:tiny:7 server")
    st = c.stats()["server"]
    check(st["weight_version"] == 2 and st["updates_committed"] == 1, f"stats {st}")
    try:
        c.update_weights(weights, version=3, bucket_bytes=256 << 10, _corrupt_bucket=1)
        check(False, "an update with a bad checksum was accepted")
    except ServerError as e:
        check(e.code == "bad_checksum", f"wanted bad_checksum, got {e.code}: {e.message}")
    st = c.stats()["server"]
    check(st["weight_version"] == 2 and not st["updating"], f"stats after the refused update {st}")
    check(greedy(c, probe) == want7, "greedy outputs changed after a refused update")
print(f"serve_mpi: tp 2: {128 - differ} of 128 samples equal the single process's; update committed, {v2} samples ended on version 2")
PY

# The C tool: a refused update (bad checksum) and an accepted one back to
# synthetic:tiny (version 4): greedy outputs then equal the reference's.
if c "$tp2_ep" push-weights --model synthetic:tiny --version 3 --corrupt-bucket 0 > "$dir/bad.json" 2> "$dir/bad.err"; then
  fail "push-weights with a bad checksum was accepted"
fi
grep -q bad_checksum "$dir/bad.err" || fail "bad checksum: $(cat "$dir/bad.err")"
c "$tp2_ep" push-weights --model synthetic:tiny --version 4 --bucket-mib 1 > "$dir/push.json" || fail "push-weights"
greedy_c() { c "$1" generate --prompts "$dir/p32.txt" --n 1 --max-tokens 16 --temperature 0 --ignore-eos > "$2" || fail "greedy on $1"; }
greedy_c "$ref_ep" "$dir/ref_greedy.jsonl"
greedy_c "$tp2_ep" "$dir/tp2_greedy.jsonl"
$py - "$dir/tp2_greedy.jsonl" "$dir/ref_greedy.jsonl" <<'PY' || fail "greedy outputs after push-weights version 4"
import json, sys
a, b = ({(r["request_id"], r["sample"]): r["token_ids"] for r in map(json.loads, open(f))} for f in sys.argv[1:3])
assert a == b and len(a) == 32
PY
BUILD="$build" timeout 120 $py "$(dirname "$0")/serve_pause_ranks.py" "$tp2_ep" "$dir/w7.bin" "$dir/w7.jsonl" 5 resume ||
  fail "pause keep on the tp 2 job"

# SIGTERM to both ranks while samples stream: each gets its done.
c "$tp2_ep" generate --prompts "$dir/p32.txt" --n 4 --max-tokens 3000 --ignore-eos --temperature 1 --seed 3 \
  > "$dir/term.jsonl" 2> "$dir/term.err" &
gen_pid=$!
sleep 1
ranks=($(ranks_of "$tp2_job"))
[ ${#ranks[@]} -eq 2 ] || fail "found ${#ranks[@]} ranks of the tp 2 job"
stop_job "$dir/tp2.log" "${ranks[@]}"
wait $gen_pid || fail "the client lost samples at shutdown: $(cat "$dir/term.err")"
$py -c 'import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; k={(x["request_id"],x["sample"]) for x in r}; sys.exit(0 if len(r)==len(k)==128 and any(x["finish_reason"]=="abort" for x in r) else 1)' \
  "$dir/term.jsonl" || fail "shutdown dones: $(wc -l < "$dir/term.jsonl") lines"

# --- two engines of tp 1 ------------------------------------------------------
start_mpi e2 2 1; e2_ep=$ep; e2_job=$mpi_pid
hello_check "$e2_ep" 1 2
gen "$e2_ep" 11 "$dir/e2_11.jsonl"
same_as "$dir/e2_11.jsonl" "$dir/ref11.jsonl" 0
c "$e2_ep" stats | $py -c 'import json,sys; d=json.load(sys.stdin); sys.exit(0 if d["scheduler"]["finished"] == 128 and d["scheduler"]["kv_blocks_free"] == 1024 else 1)' ||
  fail "stats of two engines are not their sums"
c "$e2_ep" push-weights --model synthetic:tiny:7 --version 2 > "$dir/push2.json" || fail "push-weights on two engines"
$cli push-weights --model synthetic:tiny --export "$dir/w0.bin" > "$dir/w0.jsonl" || fail "export synthetic:tiny"
BUILD="$build" timeout 120 $py "$(dirname "$0")/serve_pause_ranks.py" "$e2_ep" "$dir/w0.bin" "$dir/w0.jsonl" 3 pause ||
  fail "pause keep on two engines"
c "$e2_ep" push-weights --model synthetic:tiny:7 --version 4 > "$dir/push4.json" || fail "push-weights back to synthetic:tiny:7"
greedy_c "$fresh_ep" "$dir/fresh_greedy.jsonl"
greedy_c "$e2_ep" "$dir/e2_greedy.jsonl"
$py - "$dir/e2_greedy.jsonl" "$dir/fresh_greedy.jsonl" <<'PY' || fail "greedy outputs of two engines after the update"
import json, sys
a, b = ({(r["request_id"], r["sample"]): r["token_ids"] for r in map(json.loads, open(f))} for f in sys.argv[1:3])
assert a == b and len(a) == 32
PY
ranks=($(ranks_of "$e2_job"))
[ ${#ranks[@]} -eq 2 ] || fail "found ${#ranks[@]} ranks of the two-engine job"
# SIGTERM to rank 1 alone: every rank stops.
rank1=$(for p in "${ranks[@]}"; do grep -qz '^OMPI_COMM_WORLD_RANK=1$' "/proc/$p/environ" 2>/dev/null && echo "$p"; done)
[ -n "$rank1" ] || fail "rank 1 of the two-engine job not found"
stop_job "$dir/e2.log" "$rank1"
# Rank 0 logs the serving summary of both engines while serving, and the
# run's at shutdown.
grep -Eq "[0-9.]+ tokens/s, [0-9]+ running, [0-9]+ waiting, KV [0-9.]+% used \(0 of 1024 pages\)|[0-9.]+ tokens/s, [0-9]+ running, [0-9]+ waiting, KV [0-9.]+% used \([0-9]+ of 1024 pages\)" "$dir/e2.log" ||
  fail "no serving summary of the two engines in the log"
grep -Eq "served [0-9]+ tokens in [0-9.]+ s" "$dir/e2.log" || fail "no summary of the run at shutdown"

# A rank that cannot start (rank 0's port is taken) stops every rank.
config taken synthetic:tiny 2 "${ref_ep##*:}"
if timeout 60 "${mpi[@]}" -np 2 "$bin" serve --config "$dir/taken.json" 2> "$dir/taken.log"; then
  fail "a job whose port is taken started"
fi
grep -q "cannot bind" "$dir/taken.log" && grep -q "another rank failed to start" "$dir/taken.log" ||
  fail "no readable error when the port is taken: $(cat "$dir/taken.log")"
echo "serve_mpi: all checks passed"
