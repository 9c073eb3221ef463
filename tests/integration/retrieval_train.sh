#!/usr/bin/env bash
# models/retrieval/train_retrieval.py on the CPU with a tiny model (hidden 64,
# 2 layers, head_dim 32) over two short stages, one thread:
# - a run stopped after stage 0, resumed, stopped in the middle of stage 1
#   and resumed again, and one cut by --stop-after-minutes into parts of a
#   step or a stage's end each, end bitwise where an uninterrupted run ends;
#   a run resumed from a stop's handoff alone (BF16 weights and position,
#   fresh optimizer) goes on to the end (float32
#   weights and optimizer state, the BF16 folder, the held-out history): one
#   thread on one machine runs the same float operations in the same order;
# - --resume may add stages past the run's position, refuses to change one
#   it has begun or a run whose learning rate differs, and a folder
#   without a state; --check-transformers fails clearly without transformers
#   (and must pass where transformers is importable);
# - fp4rollout loads the folder: eval-task --kv bf16 reports every
#   (variant, context) cell of held-out prompts, and the engine's greedy
#   tokens with f32 KV are the script's own (load_policy) argmax at every
#   step, their log-probs within 1e-3 nats of the script's.
# Skips (exit 0, with a message) without python3-torch.
set -euo pipefail
name=retrieval_train
source "$(dirname "$0")/cli_setup.bash"
export PYTHONDONTWRITEBYTECODE=1   # nothing written into the source tree
# --threads sets PyTorch's own threads; Debian's PyTorch multiplies through
# OpenBLAS, whose threads only its variable sets.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1
$py -c 'import torch' 2>/dev/null || { echo "$name: SKIP: python3-torch is missing (scripts/install-deps.sh)"; exit 0; }
t_start=$SECONDS

# stage 0: 3 steps at 340 bytes (batch 5), stage 1: 4 steps at 400 (batch 4)
args=(--hidden 64 --intermediate 128 --layers 2 --heads 2 --kv-heads 1 --head-dim 32 --max-position 512
      --variants single,multikey,vartrack --stages 340:3,400:4 --batch-tokens 2048 --warmup 2 --lr 3e-3 --seed 3 --eval-n 2 --threads 1
      --log-every 1 --save-every 2)
train() { $py models/retrieval/train_retrieval.py "$@" 2>&1; }

train --out "$dir/a" "${args[@]}" > "$dir/a.log" || fail "uninterrupted run failed: $(tail -20 "$dir/a.log")"
train --out "$dir/b" "${args[@]}" --stop-after 3 > "$dir/b1.log" || fail "run to step 3 failed: $(tail "$dir/b1.log")"
[ -f "$dir/b/train_state.pt" ] && [ ! -f "$dir/b/model.safetensors" ] ||
  fail "--stop-after 3 left: $(ls "$dir/b")"
grep -q "held-out greedy exact match after stage 0" "$dir/b1.log" || fail "stage 0 ended without its accuracy line"
train --out "$dir/b" "${args[@]}" --resume --stop-after 5 > "$dir/b2.log" ||
  fail "resume to step 5 failed: $(tail "$dir/b2.log")"
grep -q "stopped after 5 steps" "$dir/b2.log" && ! grep -q "after stage 1" "$dir/b2.log" ||
  fail "the second part did not stop in stage 1: $(cat "$dir/b2.log")"
train --out "$dir/b" "${args[@]}" --resume > "$dir/b3.log" || fail "final resume failed: $(tail "$dir/b3.log")"
# A time limit stops at the first step's end past it (a limit of 0.6 ms: the
# first step), and resumes from there as a step count does: run c gets to
# the end in such pieces, each call at least one step further.
for i in $(seq 12); do
  [ -f "$dir/c/train_info.json" ] && break
  resume=(); [ -f "$dir/c/train_state.pt" ] && resume=(--resume)
  train --out "$dir/c" "${args[@]}" "${resume[@]}" --stop-after-minutes 0.00001 > "$dir/c$i.log" ||
    fail "time-limited part $i failed: $(tail "$dir/c$i.log")"
done
[ -f "$dir/c/train_info.json" ] || fail "the time-limited parts did not finish the run"
grep -q "stopped after 1 steps (--stop-after-minutes)" "$dir/c1.log" ||
  fail "the first time-limited part: $(tail -3 "$dir/c1.log")"
# Only the handoff travels (the BF16 weights and the position; train_state.pt
# stays behind): --resume goes on from it with a fresh optimizer to the same
# step count, the history of stage 0 kept, the folder exported.
train --out "$dir/d" "${args[@]}" --stop-after 4 --snapshot > "$dir/d1.log" || fail "run d to step 4: $(tail "$dir/d1.log")"
[ -f "$dir/d/handoff/weights.safetensors" ] && [ -f "$dir/d/handoff/position.json" ] ||
  fail "a stop wrote no handoff: $(ls "$dir/d")"
# --snapshot: the weights so far as a folder the engine loads, marked unfinished
[ ! -f "$dir/d/model.safetensors" ] && $py -c 'import json, sys; i = json.load(open(sys.argv[1]))
assert i["finished"] is False and i["steps"] == 4, i' "$dir/d/snapshot/train_info.json" ||
  fail "the snapshot: $(ls "$dir/d" "$dir/d/snapshot")"
"$bin" score --model "$dir/d/snapshot" --backend cpu --prompt "key A = value b" --out "$dir/snap.f32" > /dev/null 2>&1 ||
  fail "fp4rollout does not load the snapshot"
mkdir "$dir/e" && cp -r "$dir/d/handoff" "$dir/e/"
train --out "$dir/e" "${args[@]}" --resume --rewarm 2 > "$dir/e.log" || fail "resume from the handoff: $(tail "$dir/e.log")"
grep -q "no train_state.pt; going on from .*handoff at step 4 with a fresh optimizer" "$dir/e.log" ||
  fail "the handoff resume did not say so: $(head -3 "$dir/e.log")"
$py - "$dir/d" "$dir/e" <<'PY' || fail "the handoff's run"
import json, os, sys, torch
d, e = sys.argv[1], sys.argv[2]
st = os.path.getsize(d + "/train_state.pt")
hw = os.path.getsize(d + "/handoff/weights.safetensors")
assert hw * 5 < st, (hw, st)   # BF16 weights alone, against float32 weights and two moments
info = json.load(open(e + "/train_info.json"))
assert info["steps"] == 7 and [h["stage"] for h in info["heldout_accuracy"]] == [0, 1], info
assert os.path.exists(e + "/model.safetensors")
PY
# A resumed run may grow its curriculum past where it stands (the cosine then
# follows the new total), never rewrite a stage it has begun.
mkdir "$dir/f" && cp -r "$dir/d/handoff" "$dir/f/"
grown=("${args[@]/340:3,400:4/340:3,400:4,400:2:3}")   # a context again, with a batch of its own
train --out "$dir/f" "${grown[@]}" --resume --rewarm 2 > "$dir/f.log" || fail "resume with a grown curriculum: $(tail "$dir/f.log")"
grep -q "the stages after stage 1 change: 9 steps in all instead of 7" "$dir/f.log" &&
  grep -q "stages 340:3:5,400:4:4,400:2:3$" "$dir/f.log" || fail "the grown resume did not say so: $(head -5 "$dir/f.log")"
# the repeated context goes on with the prompts after the 16 its first stage drew
$py -c 'import sys; sys.argv = ["t", "--out", "x"]; sys.path.insert(0, "models/retrieval"); import train_retrieval as t
a = t.parse_args(); a.batch_tokens = 2048; st = t.parse_stages("340:3,400:4,400:2:3")
assert [t.drawn_before(st, i, a) for i in range(3)] == [0, 0, 16], [t.drawn_before(st, i, a) for i in range(3)]' ||
  fail "a repeated stage's prompts"
$py -c 'import json, sys; i = json.load(open(sys.argv[1])); assert i["steps"] == 9 and [h["stage"] for h in i["heldout_accuracy"]] == [0, 1, 2], i' \
  "$dir/f/train_info.json" || fail "the grown run's train_info.json"
set +e
train --out "$dir/d" "${args[@]/340:3,400:4/340:2,400:4}" --resume > "$dir/shrunk.log"; rc=$?
set -e
[ $rc -ne 0 ] && grep -q -- "--stages may change only the stages not yet reached (the run is at stage 1, step 1 of 340:3,400:4)" "$dir/shrunk.log" ||
  fail "a resume that rewrites a begun stage: exit $rc, $(cat "$dir/shrunk.log")"

for other in b c; do
$py - "$dir/a" "$dir/$other" <<'PY' || fail "the resumed run $other differs from the uninterrupted one"
import json, sys, torch
a, b = sys.argv[1], sys.argv[2]
sa, sb = torch.load(a + "/train_state.pt"), torch.load(b + "/train_state.pt")
assert (sa["stage"], sa["step"], sa["total_step"]) == (sb["stage"], sb["step"], sb["total_step"]) == (2, 0, 7), \
    (sa["stage"], sa["step"], sa["total_step"], sb["stage"], sb["step"], sb["total_step"])
for k, t in sa["model"].items():
    assert torch.equal(t, sb["model"][k]), "weight %s differs" % k
oa, ob = sa["opt"]["state"], sb["opt"]["state"]
assert oa.keys() == ob.keys() and oa
for i in oa:
    for k, t in oa[i].items():
        assert torch.equal(torch.as_tensor(t), torch.as_tensor(ob[i][k])), "optimizer %s of %s differs" % (k, i)
assert open(a + "/model.safetensors", "rb").read() == open(b + "/model.safetensors", "rb").read()
ia, ib = json.load(open(a + "/train_info.json")), json.load(open(b + "/train_info.json"))
for i in (ia, ib):
    del i["train_seconds"]
assert ia == ib, (ia, ib)
assert [h["stage"] for h in ia["heldout_accuracy"]] == [0, 1] and ia["steps"] == 7, ia
PY
done

set +e
train --out "$dir/b" "${args[@]/3e-3/1e-3}" --resume > "$dir/refuse.log"; rc1=$?
train --out "$dir/empty" "${args[@]}" --resume > "$dir/empty.log"; rc2=$?
set -e
[ $rc1 -ne 0 ] && grep -q -- "--resume: --lr 0.001 differs from the saved run's (0.003)" "$dir/refuse.log" ||
  fail "a resume with another --lr: exit $rc1, $(cat "$dir/refuse.log")"
[ $rc2 -ne 0 ] && grep -q "train_state.pt does not exist" "$dir/empty.log" ||
  fail "a resume without a state: exit $rc2, $(cat "$dir/empty.log")"
# A finished run resumed exports again; with transformers it cross-checks the logits.
set +e
train --out "$dir/b" "${args[@]}" --resume --check-transformers > "$dir/hf.log"; rc=$?
set -e
if $py -c 'import transformers' 2>/dev/null; then
  [ $rc -eq 0 ] && grep -q "check-transformers: transformers .* agrees" "$dir/hf.log" ||
    fail "--check-transformers: $(tail "$dir/hf.log")"
else
  [ $rc -ne 0 ] && grep -q "check-transformers needs transformers" "$dir/hf.log" ||
    fail "--check-transformers without transformers: exit $rc, $(cat "$dir/hf.log")"
fi

# The engine: eval-task on held-out prompts, one table row per cell.
$py models/retrieval/retrieval_tasks.py --split heldout --seed 3 --contexts 340,400 --n 2 --out "$dir/held.jsonl"
"$bin" eval-task --model "$dir/a" --tasks "$dir/held.jsonl" --kv bf16 --backend cpu --quiet > "$dir/table.md" \
  2> "$dir/err" || fail "eval-task failed: $(cat "$dir/err")"
for cell in "single | 340 | 2" "multikey | 340 | 2" "vartrack | 340 | 2" "single | 400 | 2" "multikey | 400 | 2" \
            "vartrack | 400 | 2" "all | all | 12"; do
  grep -q "^| bf16 | $cell | " "$dir/table.md" || fail "no row '$cell': $(cat "$dir/table.md")"
done

# The engine's greedy tokens against the script's model, teacher-forced on them.
$py - "$dir/held.jsonl" > "$dir/prompts.txt" <<'PY'
import json, sys
for line in list(open(sys.argv[1]))[:3] + [json.dumps({"prompt": "key AB"})]:
    print(",".join(str(x) for x in [256] + list(json.loads(line)["prompt"].encode())))
PY
: > "$dir/gen.jsonl"
while read -r ids; do
  "$bin" generate --model "$dir/a" --prompt-ids "$ids" --greedy --max-tokens 12 --ignore-eos --kv f32 --logprobs 2 \
    --backend cpu --json --log-level off >> "$dir/gen.jsonl" || fail "generate failed on $ids"
done < "$dir/prompts.txt"
$py - "$dir/a" "$dir/prompts.txt" "$dir/gen.jsonl" <<'PY' || fail "the engine's greedy tokens differ from the script's model"
import json, sys, torch
sys.path.insert(0, "models/torch_qwen3")
from qwen3 import greedy_cached, load_policy
model = load_policy(sys.argv[1]).eval()
prompts = [[int(x) for x in l.split(",")] for l in open(sys.argv[2])]
rows = [json.loads(l) for l in open(sys.argv[3])]
assert len(rows) == len(prompts) == 4, (len(rows), len(prompts))
worst, same = 0.0, 0
for ids, r in zip(prompts, rows):
    got = r["token_ids"]
    assert len(got) == 12, r
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids + got]))[0, len(ids) - 1:-1].double(), -1)
    for t, (tok, tops) in enumerate(zip(got, r["top_logprobs"])):
        for tid, v in tops:
            worst = max(worst, abs(float(lp[t, tid]) - v))
        # the engine's choice is the script's argmax, up to a tie within the bound
        assert float(lp[t].max() - lp[t, tok]) <= 1e-3, (ids[-20:], t, tok, int(lp[t].argmax()))
    same += greedy_cached(model, ids, 12, stop_ids=()) == got
assert worst <= 1e-3, worst
print("engine vs script: largest log-prob difference %.1e nats, greedy identical on %d of %d prompts"
      % (worst, same, len(prompts)))
PY

echo "$name: ok ($((SECONDS - t_start)) s)"
