#!/usr/bin/env bash
# Automatic recalibration of the key mean (docs/metrics.md) in a real
# `fp4rollout serve` on loopback: a CPU server on synthetic:tiny with an
# NVFP4 cache, every sample monitored and a threshold any KL passes serves
# 6 prompts x 2 samples; it recalibrates once for weight version 0 without
# losing a sample, records the new calibration file, and that file's key
# mean equals `fp4rollout calibrate` on the same texts. Greedy outputs
# after the switch equal (tokens and log-probs) those of a server started
# with the recorded file, and differ in log-probs from a server without it.
# After a weight update to synthetic:tiny:7 (version 1) it recalibrates
# again, once, and that mean equals calibrate on synthetic:tiny:7. A server
# with after_commit and no threshold leaves its starting version alone and
# recalibrates right after an update commits, to the same mean. The servers
# run in deterministic mode: the greedy comparison across servers must not
# hang on how each one happened to batch the prompts (the recalibration's
# passes are calibrate's either way).
set -euo pipefail
name=serve_recalibrate
source "$(dirname "$0")/serve_setup.bash"

$py - "$dir" <<'PY'
import random, sys
r = random.Random(1)
words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"]
for n in ("t1", "t2"):
    open(f"{sys.argv[1]}/{n}.txt", "w").write(" ".join(r.choice(words) for _ in range(300)))
r = random.Random(3)
with open(f"{sys.argv[1]}/p.txt", "w") as f:
    for i in range(6):
        f.write(",".join(["256"] + [str(r.randrange(256)) for _ in range(20 + 30 * i)]) + "\n")
PY
mkdir -p "$dir/out"
calib_args=(--context 512 --seed-tokens 64 --continue 8 --tau-steps 0)

gen() { # ENDPOINT OUT [generate options]
  local e=$1 out=$2
  shift 2
  timeout 120 "$cli" --endpoint "$e" --timeout-ms 60000 generate --prompts "$dir/p.txt" "$@" > "$out" ||
    fail "generate on $e failed"
}
same_mean() { # FILE-A FILE-B: the key_mean tensors are bit-identical
  $py - "$1" "$2" <<'PY'
import json, struct, sys
def key_mean(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    lo, hi = h["key_mean"]["data_offsets"]
    return b[8 + n + lo:8 + n + hi]
a, b = key_mean(sys.argv[1]), key_mean(sys.argv[2])
sys.exit(0 if a == b and len(a) > 0 else 1)
PY
}

mport=$(free_port)
base='"backend": "cpu", "kv_dtype": "nvfp4", "deterministic": true, "max_seqs": 8, "coordinator": {"bind": "127.0.0.1", "port": PORT}'
start_server auto "{\"model\": \"synthetic:tiny\", $base, \"kl_sample_rate\": 1.0, \"metrics_port\": $mport,
  \"recalibration\": {\"kl_threshold\": 1e-9, \"min_positions\": 50, \"texts\": [\"t1.txt\", \"t2.txt\"],
                     \"context\": 512, \"seed_tokens\": 64, \"continue\": 8, \"out_dir\": \"out\"}}"
auto_ep=$ep
gen "$auto_ep" "$dir/sampled.jsonl" --n 2 --max-tokens 60 --temperature 1 --seed 5
[ "$(wc -l < "$dir/sampled.jsonl")" -eq 12 ] || fail "expected 12 samples, got $(wc -l < "$dir/sampled.jsonl")"
grep -q "recalibrated the key mean for weight version 0" "$dir/auto.log" || fail "no recalibration logged"
[ -f "$dir/out/calib-v0.safetensors" ] || fail "no calibration file recorded"
$py - "$dir/sampled.jsonl" <<'PY' || fail "samples were lost or cut short by the recalibration"
import json, sys
s = [json.loads(l) for l in open(sys.argv[1])]
assert all(x["finish_reason"] in ("length", "stop") and x["n_tokens"] == len(x["token_ids"]) for x in s), s
assert sum(x["preemptions"] for x in s) > 0, "nothing was recomputed"
PY

"$bin" calibrate --model synthetic:tiny --backend cpu --texts "$dir/t1.txt" "$dir/t2.txt" "${calib_args[@]}" \
  --out "$dir/ref0.safetensors" --quiet > "$dir/calibrate0.log" 2>&1 || fail "calibrate failed"
same_mean "$dir/out/calib-v0.safetensors" "$dir/ref0.safetensors" ||
  fail "the recorded key mean differs from fp4rollout calibrate's"

# greedy after the switch = a server started with the recorded file
start_server with "{\"model\": \"synthetic:tiny\", $base, \"calib\": \"out/calib-v0.safetensors\"}"
with_ep=$ep
start_server without "{\"model\": \"synthetic:tiny\", $base}"
without_ep=$ep
for s in auto with without; do
  e=${s}_ep
  gen "${!e}" "$dir/greedy_$s.jsonl" --max-tokens 30 --temperature 0 --ignore-eos --no-monitor
done
$py - "$dir" <<'PY' || fail "greedy outputs after the recalibration differ from a server with the recorded file"
import json, sys
def load(n):
    return {x["request_id"]: x for x in map(json.loads, open(f"{sys.argv[1]}/greedy_{n}.jsonl"))}
a, w, o = load("auto"), load("with"), load("without")
assert a.keys() == w.keys() == o.keys() and len(a) == 6
for k in a:
    assert a[k]["token_ids"] == w[k]["token_ids"], k
    assert max(abs(x - y) for x, y in zip(a[k]["logprobs"], w[k]["logprobs"])) <= 1e-6, k
d = max(abs(x - y) for k in a for x, y in zip(a[k]["logprobs"], o[k]["logprobs"]) if a[k]["token_ids"] == o[k]["token_ids"])
assert d > 1e-6, "the recalibrated server serves like one without a key mean"
print("serve_recalibrate: greedy after the switch equals the recorded calibration; log-probs move by up to %.3g "
      "against no key mean" % d)
PY

# a new weight version: judged afresh, recalibrated once more
timeout 60 "$cli" --endpoint "$auto_ep" --timeout-ms 20000 push-weights --model synthetic:tiny:7 --version 1 \
  > "$dir/push.json" || fail "push-weights failed"
gen "$auto_ep" "$dir/sampled1.jsonl" --n 2 --max-tokens 60 --temperature 1 --seed 6
gen "$auto_ep" "$dir/sampled2.jsonl" --n 2 --max-tokens 60 --temperature 1 --seed 7
[ "$(grep -c "recalibrated the key mean" "$dir/auto.log")" -eq 2 ] || fail "expected exactly 2 recalibrations"
grep -q "recalibrated the key mean for weight version 1" "$dir/auto.log" || fail "version 1 was not recalibrated"
"$bin" calibrate --model synthetic:tiny:7 --backend cpu --texts "$dir/t1.txt" "$dir/t2.txt" "${calib_args[@]}" \
  --out "$dir/ref1.safetensors" --quiet > "$dir/calibrate1.log" 2>&1 || fail "calibrate failed"
same_mean "$dir/out/calib-v1.safetensors" "$dir/ref1.safetensors" ||
  fail "the key mean recorded for version 1 differs from calibrate on synthetic:tiny:7"
$py - "http://127.0.0.1:$mport/metrics.json" <<'PY' || fail "the metrics do not count the recalibrations"
import json, sys, time, urllib.request
time.sleep(0.5)
j = json.load(urllib.request.urlopen(sys.argv[1], timeout=10))
assert j["recalibrations_total"] == 2 and j["recalibration_failures_total"] == 0, j
assert j["last_recalibration_version"] == 1 and j["last_recalibration_seconds"] > 0, j
print("serve_recalibrate: metrics: 2 recalibrations, the last for version 1 in %.3f s (KL %.3g nats)" %
      (j["last_recalibration_seconds"], j["last_recalibration_kl_nats"]))
PY
# after_commit: no KL needed, the commit itself triggers it
mkdir -p "$dir/out_commit"
start_server commit "{\"model\": \"synthetic:tiny\", $base, \"recalibration\": {\"after_commit\": true,
  \"texts\": [\"t1.txt\", \"t2.txt\"], \"context\": 512, \"seed_tokens\": 64, \"continue\": 8, \"out_dir\": \"out_commit\"}}"
commit_ep=$ep
gen "$commit_ep" "$dir/c0.jsonl" --max-tokens 20 --temperature 0
grep -q "recalibrat" "$dir/commit.log" && fail "after_commit recalibrated the starting version"
timeout 60 "$cli" --endpoint "$commit_ep" --timeout-ms 20000 push-weights --model synthetic:tiny:7 --version 1 \
  > "$dir/push_c.json" || fail "push-weights failed"
for _ in $(seq 100); do grep -q "recalibrated the key mean for weight version 1" "$dir/commit.log" && break; sleep 0.05; done
grep -q "weight version 1 committed: recalibrating" "$dir/commit.log" || fail "no recalibration after the commit"
for _ in $(seq 100); do [ -f "$dir/out_commit/calib-v1.safetensors" ] && break; sleep 0.05; done
same_mean "$dir/out_commit/calib-v1.safetensors" "$dir/ref1.safetensors" ||
  fail "the key mean recalibrated after the commit differs from calibrate on synthetic:tiny:7"
echo "serve_recalibrate: all checks passed"
