#!/usr/bin/env bash
# The long-reasoning arithmetic task of the DAPO example (examples/dapo) on
# the CPU, at a tiny size (2 numbers of 2 digits):
# 1. arith_task.py's self-check (generator, verifier, >= 1 KB solutions at
#    the default size);
# 2. the warm-up: sft.py runs 1 step, then --resume runs 9 more (enough to
#    learn the format, so that DAPO's groups differ in length); the folder
#    is a float32 checkpoint with calibration texts, a 10-row loss log and a
#    held-out evaluation; the cached greedy decoder matches qwen3.greedy;
# 3. two DAPO steps on the arith task against a real `fp4rollout serve`
#    (deterministic mode, BF16 KV) started from that checkpoint, in one go,
#    the trainer's gradients accumulated one response at a time;
# 4. the same two steps as one step, a fresh server, and --resume (after
#    rows of a step past the saved state were appended, as a run killed
#    between a save and the next leaves them): metrics.csv (every column but
#    the timings) and samples.jsonl are the same as the uninterrupted run's,
#    byte for byte, and so are the final weights; the resumed server ends at
#    version 2 and step 1's tokens carry version 1;
# 5. run C, moved as B's handoff alone after its first step, goes on from it
#    (its server starting from the handoff's BF16 policy).
# Skips (exit 0, with a message) without python3-torch, python3-matplotlib
# or the tq6 checkpoint (../shared/models/tq6, or $TQ6).
set -euo pipefail
name=dapo_arith
source "$(dirname "$0")/dapo_setup.bash"
t_start=$SECONDS

# 1. The task.
$py "$ex/arith_task.py" --self-check > "$dir/task.out" 2>&1 || fail "arith_task self-check: $(cat "$dir/task.out")"

# 2. The warm-up, interrupted after its first step and resumed.
sft=(--model "$tq6" --out "$dir/sft" --batch 4 --operands 2 --digits 2 --lr 1e-3 --warmup-steps 1 --threads 1
     --save-every 1 --seed 3)
$py "$ex/sft.py" "${sft[@]}" --steps 1 --eval-n 0 > "$dir/sft1.log" 2>&1 || fail "sft.py: $(tail -5 "$dir/sft1.log")"
$py "$ex/sft.py" "${sft[@]}" --steps 10 --eval-n 2 --resume > "$dir/sft2.log" 2>&1 ||
  fail "sft.py --resume: $(tail -5 "$dir/sft2.log")"
grep -q "resumed at step 1" "$dir/sft2.log" || fail "sft.py did not resume: $(cat "$dir/sft2.log")"
$py - "$dir/sft" "$tq6" <<'PY' || fail "the warm-up checkpoint"
import csv, json, os, sys
sys.path[:0] = ["examples/dapo", "models/torch_qwen3"]
from arith_task import EOS, problems
from qwen3 import greedy, greedy_batch, load_policy
out, tq6 = sys.argv[1], sys.argv[2]

def check(cond, what):
    if not cond:
        raise SystemExit(f"dapo_arith: {what}")

cfg = json.load(open(f"{out}/config.json"))
check(cfg["torch_dtype"] == "float32", f"config torch_dtype {cfg['torch_dtype']}")
with open(f"{out}/model.safetensors", "rb") as f:
    n = int.from_bytes(f.read(8), "little")
    head = json.loads(f.read(n))
check({v["dtype"] for k, v in head.items() if k != "__metadata__"} == {"F32"}, "model.safetensors is not F32")
rows = list(csv.DictReader(open(f"{out}/sft_log.csv")))
check([int(r["step"]) for r in rows] == list(range(10)), f"sft_log.csv steps {[r['step'] for r in rows]}")
ev = json.load(open(f"{out}/sft_eval.json"))
check(ev["n"] == 2 and ev["steps"] == 10 and 0 <= ev["accuracy"] <= 1 and 0 <= ev["sampled_accuracy"] <= 1,
      f"sft_eval.json {ev}")
texts = [open(f"{out}/texts/calib_{i}.txt").read() for i in range(4)]
check(all(len(t) == 4095 and "answer: " in t for t in texts), "calibration texts")
m = load_policy(out)
ps = problems(0, "t", 2, 2, 2)
fast = greedy_batch(m, [p.token_ids for p in ps], 12, EOS)
slow = [greedy(m, p.token_ids, 12, (EOS,)) for p in ps]
check(fast == slow, f"cached greedy {fast} differs from qwen3.greedy {slow}")
PY

# 3 and 4. DAPO on the arith task, uninterrupted (A) and stopped and resumed (B).
serve='{"model": "'$dir/sft'", "backend": "cpu", "kv_dtype": "bf16", "max_seqs": 8, "kv_blocks": 16,
 "chunk": 256, "deterministic": true, "metrics_port": 0, "kl_sample_rate": 0,
 "coordinator": {"bind": "127.0.0.1", "port": PORT}}'
dapo=(--model "$dir/sft" --task arith --operands 2 --digits 2 --batch-groups 1 --n 2 --max-tokens 96
      --overlong-cache 64 --oversample 1 --max-attempts 2 --filter-on reward --monitor-share 1 --lr 1e-4
      --seed 11 --threads 1 --micro-batch 1 --no-plot)
train() { # LOG ENDPOINT OPTIONS...
  local log=$1 e=$2
  shift 2
  BUILD="$build" timeout 300 $py "$ex/train.py" --server "$e" "${dapo[@]}" "$@" > "$dir/$log" 2>&1 ||
    fail "train.py $*: $(tail -20 "$dir/$log")"
}
start_server a "$serve"
train trainA.log "$ep" --out "$dir/A" --steps 2 --save-every 1
kill -TERM "${pids[-1]}"
start_server b1 "$serve"
train trainB1.log "$ep" --out "$dir/B" --steps 1 --save-every 1
kill -TERM "${pids[-1]}"
# what a run moved to another machine as its handoff alone carries (run C below)
mkdir -p "$dir/C" && cp -r "$dir/B/handoff" "$dir/B/metrics.csv" "$dir/C/"
# what a run killed after writing step 1 but before saving it leaves behind
sed -n '$p' "$dir/A/metrics.csv" >> "$dir/B/metrics.csv"
grep '"step": 1,' "$dir/A/samples.jsonl" | head -1 >> "$dir/B/samples.jsonl"
start_server b2 "$serve"
train trainB2.log "$ep" --out "$dir/B" --steps 2 --resume
grep -q "pushed the saved weights as version 1" "$dir/trainB2.log" || fail "no resume push: $(cat "$dir/trainB2.log")"

BUILD="$build" $py - "$dir/A" "$dir/B" "$ep" <<'PY' || fail "A and B differ; $(tail -3 "$dir/trainB2.log")"
import csv, json, math, os, sys
sys.path[:0] = ["examples/dapo", "models/torch_qwen3", os.path.join("trainer_bridge", "client", "python")]
import run_state
from fp4rollout_client import RolloutClient
a, b, ep = sys.argv[1:4]

def check(cond, what):
    if not cond:
        raise SystemExit(f"dapo_arith: {what}")

timing = {"gen_s", "reward_s", "train_s", "push_s", "step_s"}
ra, rb = (list(csv.DictReader(open(f"{d}/metrics.csv"))) for d in (a, b))
check(len(ra) == 2 and len(rb) == 2, f"metrics.csv rows: {len(ra)} and {len(rb)}, want 2")
check("lines_right_mean" in ra[0] and "answer_found_frac" in ra[0], "the arith columns are missing")
for i, (x, y) in enumerate(zip(ra, rb)):
    for k in x:
        check(k in timing or x[k] == y[k], f"step {i}: {k} = {x[k]} uninterrupted, {y[k]} resumed")
        check(x[k] not in (None, "") and math.isfinite(float(x[k])), f"step {i}: {k} = {x[k]!r}")
    check(int(x["rollout_version"]) == i and int(x["pushed_version"]) == i + 1, f"step {i}: versions")
    check(int(x["monitored_samples"]) >= 2 and float(x["divergence_kl_mean"]) == 0,
          f"step {i}: a BF16 cache against its BF16 shadow: {x['divergence_kl_mean']}")
    check(float(x["grad_norm"]) > 0 or int(x["groups_kept"]) == 0, f"step {i}: no gradient")
sa, sb = (open(f"{d}/samples.jsonl").read() for d in (a, b))
check(sa == sb, "samples.jsonl differs")
samples = [json.loads(l) for l in sa.splitlines()]
check(len(samples) >= 4 and {tuple(s["weight_versions"]) for s in samples if s["step"] == 1} == {(1,)},
      "step 1's tokens do not carry version 1")
check(all(s["n_tokens"] <= 96 and s["score"] in (0.0, 1.0) and "lines_right" in s for s in samples), "samples")
check(len(open(f"{b}/resumes.jsonl").read().splitlines()) == 1, "resumes.jsonl")
pa, pb = (run_state.load_state(d, "cpu") for d in (a, b))
check(pa["step"] == 2 and pb["step"] == 2 and pa["group_counter"] == pb["group_counter"], "saved steps")
check(all(bool((pa["policy"][k] == pb["policy"][k]).all()) for k in pa["policy"]), "the final weights differ")
with RolloutClient(ep, timeout_ms=20000) as c:
    st = c.stats()["server"]
check(st["weight_version"] == 2 and st["updates_committed"] == 2 and st["updates_failed"] == 0, f"stats {st}")
PY

# 5. Run C: step 1 from B's handoff alone (no state.pt, no warm-up folder):
#    its server and trainer start from the handoff's BF16 policy, the trainer
#    says so, the step's tokens carry version 1 and the server ends at 2.
handoff_serve=${serve//"$dir/sft"/"$dir/C/handoff"}
start_server c "$handoff_serve"
BUILD="$build" timeout 300 $py "$ex/train.py" --server "$ep" "${dapo[@]/"$dir/sft"/"$dir/C/handoff"}" --out "$dir/C" \
  --steps 2 --resume > "$dir/trainC.log" 2>&1 || fail "train.py from the handoff: $(tail -20 "$dir/trainC.log")"
grep -q "no state.pt; going on from .*handoff at step 1 with its BF16 policy and a fresh optimizer" "$dir/trainC.log" ||
  fail "the handoff resume did not say so: $(head -5 "$dir/trainC.log")"
BUILD="$build" $py - "$dir/C" "$ep" <<'PY' || fail "run C; $(tail -3 "$dir/trainC.log")"
import csv, json, os, sys
sys.path[:0] = [os.path.join("trainer_bridge", "client", "python")]
from fp4rollout_client import RolloutClient
c, ep = sys.argv[1:3]
rows = list(csv.DictReader(open(f"{c}/metrics.csv")))
assert len(rows) == 2 and int(rows[1]["rollout_version"]) == 1 and int(rows[1]["pushed_version"]) == 2, rows
samples = [json.loads(l) for l in open(f"{c}/samples.jsonl")]
assert samples and {tuple(s["weight_versions"]) for s in samples} == {(1,)}, "step 1's tokens do not carry version 1"
with RolloutClient(ep, timeout_ms=20000) as cl:
    st = cl.stats()["server"]
assert st["weight_version"] == 2 and st["updates_failed"] == 0, st
PY

echo "$name: $(grep -o 'held-out:.*' "$dir/sft2.log")"
echo "$name: $(grep '^step' "$dir/trainA.log" | tr '\n' ' ')"
echo "$name: all checks passed in $((SECONDS - t_start)) s"
