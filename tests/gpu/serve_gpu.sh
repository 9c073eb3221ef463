#!/usr/bin/env bash
# `fp4rollout serve` on the CUDA backend (one GPU), tq6 with an NVFP4 cache,
# every sample monitored, the metrics PUB socket and automatic recalibration
# on (a threshold any KL passes):
#  - 8 prompts x 2 samples all end; the server recalibrates once for version
#    0 and records the file; its key mean equals `fp4rollout calibrate
#    --backend cuda` on the same texts and settings to 1e-4 relative;
#  - greedy outputs afterwards equal a CUDA server started with the recorded
#    file (the device key mean was switched in place, graphs and all);
#  - a PUB subscriber gets a snapshot counting the recalibration;
#  - tq6 pushed again as version 1 (push-weights, bf16) commits, and greedy
#    outputs stay those of tq6.
# Needs a GPU, tq6 ($FR_TQ6_DIR or ../shared/models/tq6) and the runtime
# libraries of ZeroMQ and msgpack; skipped with a message otherwise.
# usage: tests/gpu/serve_gpu.sh [BUILD_DIR]
set -euo pipefail
name=serve_gpu
BUILD=${1:-${BUILD:-build}}
source "$(dirname "$0")/../integration/serve_setup.bash"
need_gpu_tq6
texts=("$tq6/texts/calib_0.txt" "$tq6/texts/calib_1.txt")
$py - "$dir/p.txt" <<'PY'
import random, sys
r = random.Random(4)
with open(sys.argv[1], "w") as f:
    for i in range(8):
        f.write(",".join(["256"] + [str(r.randrange(256)) for _ in range(40 + 50 * i)]) + "\n")
PY
mkdir -p "$dir/out"
pport=$(free_port)
base="\"model\": \"$tq6\", \"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16, \"kv_blocks\": 256, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}"
start_server auto "{$base, \"kl_sample_rate\": 1.0, \"metrics_pub_port\": $pport,
  \"recalibration\": {\"kl_threshold\": 1e-9, \"min_positions\": 200, \"texts\": [\"${texts[0]}\", \"${texts[1]}\"],
                     \"context\": 2048, \"seed_tokens\": 256, \"continue\": 16, \"out_dir\": \"out\"}}"
auto_ep=$ep
gen() { timeout 300 "$cli" --endpoint "$1" --timeout-ms 120000 generate --prompts "$dir/p.txt" "${@:3}" > "$2" ||
          fail "generate on $1 failed"; }
gen "$auto_ep" "$dir/sampled.jsonl" --n 2 --max-tokens 64 --temperature 1 --seed 3
[ "$(wc -l < "$dir/sampled.jsonl")" -eq 16 ] || fail "expected 16 samples"
grep -q "recalibrated the key mean for weight version 0" "$dir/auto.log" || fail "no recalibration"
timeout 30 "$cli" --endpoint "tcp://127.0.0.1:$pport" --timeout-ms 10000 watch-metrics --count 1 > "$dir/snap.json" ||
  fail "no metrics snapshot"
$py -c 'import json,sys; j=json.load(open(sys.argv[1])); sys.exit(0 if j["recalibrations_total"] == 1 else 1)' \
  "$dir/snap.json" || fail "the snapshot does not count the recalibration: $(cat "$dir/snap.json")"
"$bin" calibrate --model "$tq6" --backend cuda --texts "${texts[@]}" --context 2048 --seed-tokens 256 --continue 16 \
  --tau-steps 0 --out "$dir/ref.safetensors" --quiet > "$dir/calibrate.log" 2>&1 || fail "calibrate failed"
$py - "$dir/out/calib-v0.safetensors" "$dir/ref.safetensors" <<'PY' || fail "the recorded key mean differs from calibrate's"
import json, struct, sys
def key_mean(path):
    b = open(path, "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    h = json.loads(b[8:8 + n])
    lo, hi = h["key_mean"]["data_offsets"]
    return struct.unpack("<%df" % ((hi - lo) // 4), b[8 + n + lo:8 + n + hi])
a, b = key_mean(sys.argv[1]), key_mean(sys.argv[2])
d = max(abs(x - y) for x, y in zip(a, b)) / max(abs(y) for y in b)
print("serve_gpu: recorded key mean against calibrate --backend cuda: %.3g relative" % d)
sys.exit(0 if d <= 1e-4 else 1)
PY
start_server with "{$base, \"calib\": \"out/calib-v0.safetensors\"}"
with_ep=$ep
gen "$auto_ep" "$dir/g_auto.jsonl" --max-tokens 48 --temperature 0 --ignore-eos --no-monitor
gen "$with_ep" "$dir/g_with.jsonl" --max-tokens 48 --temperature 0 --ignore-eos
same_tokens() { $py - "$1" "$2" <<'PY'
import json, sys
a, b = ({x["request_id"]: x["token_ids"] for x in map(json.loads, open(p))} for p in sys.argv[1:3])
sys.exit(0 if a == b and len(a) == 8 else 1)
PY
}
same_tokens "$dir/g_auto.jsonl" "$dir/g_with.jsonl" || fail "greedy after the switch differs from a server with the file"
timeout 300 "$cli" --endpoint "$with_ep" --timeout-ms 120000 push-weights --model "$tq6" --version 1 --dtype bf16 \
  > "$dir/push.json" || fail "push-weights failed"
cat "$dir/push.json"
gen "$with_ep" "$dir/g_with1.jsonl" --max-tokens 48 --temperature 0 --ignore-eos
same_tokens "$dir/g_with.jsonl" "$dir/g_with1.jsonl" || fail "greedy changed after pushing the same weights"
echo "serve_gpu: all checks passed"
