#!/usr/bin/env bash
# The DAPO example (examples/dapo) end to end on the CPU: the plain-PyTorch
# Qwen3 policy matches transformers' golden logits of tq6; two training steps
# (2 groups x 2 samples) against a real `fp4rollout serve` (tq6, NVFP4 KV,
# every request monitored) write metrics.csv with 2 rows of finite values
# and curves.png; the server ends at weight version 2 with 2 committed
# updates; step 0's tokens carry version 0 and step 1's version 1; the
# reward sandbox gives the expected verdicts.
# Skips (exit 0, with a message) without python3-torch, python3-matplotlib
# or the tq6 checkpoint (../shared/models/tq6, or $TQ6).
set -euo pipefail
name=dapo_smoke
source "$(dirname "$0")/dapo_setup.bash"
[ -f "$tq6/golden.safetensors" ] || { echo "$name: SKIP: tq6 has no golden.safetensors ($tq6)"; exit 0; }
t_start=$SECONDS

# 1. The policy's forward against transformers' float32 logits.
$py models/torch_qwen3/qwen3.py --model "$tq6" --check-golden p1,p2,p6 --tol 1e-3 > "$dir/golden.out" 2>&1 ||
  fail "the policy's logits differ from golden.safetensors: $(cat "$dir/golden.out")"

# 2. The reward sandbox: right and wrong types, syntax errors, blocked
#    sockets, processes and file writes, a memory bomb, a CPU hog.
$py "$ex/task.py" > "$dir/task.out" 2>&1 || fail "reward sandbox self-check: $(cat "$dir/task.out")"

# 3. Two DAPO steps against a CPU server.
port=$(free_port)
cat > "$dir/serve.json" <<EOF
{"model": "$tq6", "backend": "cpu", "kv_dtype": "nvfp4", "max_seqs": 8, "kv_blocks": 16, "chunk": 256,
 "metrics_port": 0, "kl_sample_rate": 0, "coordinator": {"bind": "127.0.0.1", "port": $port}}
EOF
"$bin" serve --config "$dir/serve.json" 2> "$dir/serve.log" &
server_pid=$!
for _ in $(seq 400); do
  grep -q "listening on" "$dir/serve.log" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || fail "the server exited at start"
  sleep 0.05
done
grep -q "listening on" "$dir/serve.log" || fail "the server did not start listening"
ep=tcp://127.0.0.1:$port

BUILD="$build" timeout 300 $py "$ex/train.py" --server "$ep" --model "$tq6" --out "$dir/run" --steps 2 \
  --batch-groups 2 --n 2 --max-tokens 24 --overlong-cache 8 --shots 0 --oversample 2 --max-attempts 8 \
  --monitor-share 1 --lr 1e-5 --seed 5 --threads 2 > "$dir/train.log" 2>&1 || fail "train.py failed: $(tail -30 "$dir/train.log")"

# 4. What the run left behind, and the server's view of it.
BUILD="$build" $py - "$dir/run" "$ep" <<'PY' || fail "checks of the run failed; train.log: $(tail -5 "$dir/train.log")"
import csv, json, math, os, sys
sys.path.insert(0, os.path.join("trainer_bridge", "client", "python"))
from fp4rollout_client import RolloutClient
run, ep = sys.argv[1], sys.argv[2]

def check(cond, what):
    if not cond:
        raise SystemExit(f"dapo_smoke: {what}")

rows = list(csv.DictReader(open(f"{run}/metrics.csv")))
check(len(rows) == 2, f"metrics.csv has {len(rows)} rows, want 2")
for i, r in enumerate(rows):
    for k, v in r.items():
        check(v not in (None, "") and math.isfinite(float(v)), f"step {i}: {k} = {v!r} is not a finite number")
    check(int(r["step"]) == i and int(r["rollout_version"]) == i and int(r["pushed_version"]) == i + 1,
          f"step {i}: versions {r['rollout_version']} -> {r['pushed_version']}")
    check(float(r["current_version_share"]) == 1 and float(r["version_lag_mean"]) == 0,
          f"step {i}: lag {r['version_lag_mean']}, current share {r['current_version_share']}")
    # 2 informative groups of 2, or fewer after the attempt cap (none: 2 uninformative ones)
    kept = int(r["groups_kept"])
    check(int(r["samples_trained"]) == 2 * (kept or 2) and 1 <= int(r["attempts"]) <= 8, f"step {i}: batch {r}")
    check(0 <= float(r["score_mean"]) <= 1 and float(r["response_len_mean"]) >= 1, f"step {i}: {r}")
    check(float(r["mismatch_kl"]) >= 0 and 0 <= float(r["rollout_probs_diff_mean"]) <= 1, f"step {i}: mismatch")
    # the trainer recomputes the rollout's log-probs: NVFP4 KV moves them a little, not a lot
    check(float(r["mismatch_kl"]) < 0.05, f"step {i}: mismatch_kl {r['mismatch_kl']} is too large")
    check(int(r["monitored_samples"]) >= 4 and 0 <= float(r["divergence_kl_mean"]) < 0.05 and
          0 <= float(r["divergence_top1_agreement"]) <= 1, f"step {i}: divergence {r}")
    check(float(r["grad_norm"]) > 0 or int(r["groups_kept"]) == 0, f"step {i}: no gradient")
    check(float(r["lr"]) == 1e-5, f"step {i}: lr {r['lr']}")

samples = [json.loads(l) for l in open(f"{run}/samples.jsonl")]
for step in (0, 1):
    ss = [s for s in samples if s["step"] == step]
    check(len(ss) >= 4 and len(ss) % 2 == 0, f"step {step}: {len(ss)} samples")
    check(all(s["weight_versions"] == [step] for s in ss),
          f"step {step}: versions {sorted({tuple(s['weight_versions']) for s in ss})}, want [{step}]")
    check(sum(s["trained"] for s in ss) == int(rows[step]["samples_trained"]), f"step {step}: trained samples")
    for s in ss:
        check(s["score"] in (0.0, 1.0) and s["reward"] <= s["score"] and s["n_tokens"] <= 24, f"sample {s}")

with RolloutClient(ep, timeout_ms=20000) as c:
    st = c.stats()["server"]
check(st["weight_version"] == 2 and st["updates_committed"] == 2 and st["updates_failed"] == 0, f"stats {st}")
check(os.path.getsize(f"{run}/curves.png") > 10000, "curves.png is missing or empty")
with open(f"{run}/curves.png", "rb") as f:
    check(f.read(8) == b"\x89PNG\r\n\x1a\n", "curves.png is not a PNG")
PY

echo "$name: $(cat "$dir/golden.out")"
echo "$name: $(grep -c '' "$dir/run/samples.jsonl") samples, $(grep '^step' "$dir/train.log" | tr '\n' ' ')"
echo "$name: all checks passed in $((SECONDS - t_start)) s"
