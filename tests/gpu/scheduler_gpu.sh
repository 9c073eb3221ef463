#!/usr/bin/env bash
# The continuous-batching scheduler on the CUDA backend: decode-only batches
# take the decode graphs with sampling on the device, and only monitored or
# teacher-forced rows bring their logits to the host. Checks, for tq6 (byte
# vocabulary) and the Qwen3-4B shape (152k vocabulary, synthetic weights):
#  - with the shadow stepped apart from the serving batch (FR_SHADOW_CARRY=0),
#    monitoring does not change what is generated: sampled tokens and
#    log-probs with --kl-sample-rate 0.25 equal those with 0, bit for bit;
#  - every monitored sample reports a finite KL, and only they do;
#  - with the shadow carried in the serving batch (the default), the matrix
#    products run over more rows, which may change logits by rounding: on
#    tq6 at least 3/4 of the samples must still equal the run apart token
#    for token, and where they do, the KL must agree within 2% (or 1e-9);
#    the synthetic Qwen3-4B weights give nearly flat distributions, where
#    rounding decides sampled tokens, so there the shares are only printed;
#  - the carried shadow's own launches on a side stream (the default with
#    an FP4 cache) give exactly what they give on the serving stream
#    (FR_RIDER_SIDE=0): the same kernels on the same inputs, so tokens,
#    log-probs and divergence figures are identical;
#  - on tq6, greedy tokens from the scheduler equal `generate`'s (the
#    sampler's keys are the same; greedy makes the check independent of
#    how batches are composed, up to exact logit ties);
#  - the sampling options on CUDA (rows with them come to the host and are
#    drawn by the CPU sampler): greedy with --logprobs 5 --prompt-logprobs
#    gives the tokens of the run without them (log-probs within 1e-5), each
#    token first in its top list with its own log-prob, prompt log-probs for
#    every prompt token of each prompt's first sample only; --min-tokens 8
#    keeps the stop ids (the greedy first tokens) out of the first 8 tokens;
#  - text on CUDA (the tokens reach the host every step; the text and stop
#    strings are the scheduler's, on the host): with Qwen3's tokenizer
#    (../shared/tokenizers/qwen3 or $FR_TOKENIZERS_DIR) on the Qwen3-4B
#    shape, generate's text is its tokens decoded (fp4rollout detokenize);
#    on tq6, a stop string taken from a greedy sample's text ends every
#    sample whose text holds it, at the token that completes it, the text
#    cut before it, and no other sample.
# Needs a GPU; tq6 from $FR_TQ6_DIR or ../shared/models/tq6 (its cases skip
# without it).
# usage: tests/gpu/scheduler_gpu.sh [BUILD_DIR]
set -euo pipefail
name=scheduler_gpu
build=${1:-${BUILD:-build}}
bin=$build/fp4rollout
py=/usr/bin/python3
command -v $py >/dev/null || py=python3
fail() { echo "$name: FAIL: $*" >&2; exit 1; }
if ! nvidia-smi -L >/dev/null 2>&1; then echo "$name: SKIP: no GPU"; exit 0; fi
[ -x "$bin" ] || fail "$bin is missing (run make)"
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

prompts() { # FILE COUNT VOCAB FIRST
  $py - "$@" <<'PY'
import random, sys
path, count, vocab, first = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
r = random.Random(7)
with open(path, "w") as f:
    for i in range(count):
        f.write(",".join([str(first)] + [str(r.randrange(vocab)) for _ in range(20 + 37 * i)]) + "\n")
PY
}

close_generation() { # APART.jsonl CARRIED.jsonl LABEL MIN_EQUAL_SHARE
  $py - "$@" <<'PY' || fail "$3: the carried shadow's run differs too much from the run apart"
import json, sys
a = {(j["request_id"], j["sample"]): j for j in map(json.loads, open(sys.argv[1]))}
b = {(j["request_id"], j["sample"]): j for j in map(json.loads, open(sys.argv[2]))}
assert a.keys() == b.keys(), "different samples"
same = [k for k in a if a[k]["token_ids"] == b[k]["token_ids"]]
kl = [k for k in same if "kl_mean" in a[k]]
assert all(("kl_mean" in a[k]) == ("kl_mean" in b[k]) for k in a), "different samples monitored"
bad = [k for k in kl if abs(a[k]["kl_mean"] - b[k]["kl_mean"]) > 1e-9 + 0.02 * abs(a[k]["kl_mean"])]
print("%s: %d of %d samples equal to the run apart, %d monitored among them, %d KL outside 2%%"
      % (sys.argv[3], len(same), len(a), len(kl), len(bad)))
for k in bad[:3]:
    print("  %s: kl %.6g apart, %.6g carried" % (k, a[k]["kl_mean"], b[k]["kl_mean"]))
need = float(sys.argv[4])
sys.exit(0 if len(same) >= need * len(a) and (kl or need == 0) and not bad else 1)
PY
}

same_generation() { # A.jsonl B.jsonl LABEL: tokens and logprobs equal; KL only where monitored
  $py - "$@" <<'PY' || fail "$3: monitoring changed the generation"
import json, math, sys
a = [json.loads(l) for l in open(sys.argv[1])]
b = [json.loads(l) for l in open(sys.argv[2])]
key = lambda j: (j["request_id"], j["sample"])
a.sort(key=key); b.sort(key=key)
assert len(a) == len(b) and len(a) > 0, "sample counts differ"
mon = 0
for x, y in zip(a, b):
    assert key(x) == key(y)
    assert x["token_ids"] == y["token_ids"], "tokens differ at %s" % (key(x),)
    assert x["logprobs"] == y["logprobs"], "log-probs differ at %s" % (key(x),)
    assert "kl_mean" not in x, "an unmonitored run reports KL"
    if "kl_mean" in y:
        mon += 1
        assert math.isfinite(y["kl_mean"]) and y["top1_agreement"] >= 0, "bad KL %s" % y
assert 0 < mon < len(b), "monitored %d of %d" % (mon, len(b))
print("%s: %d samples, %d monitored, tokens and log-probs equal" % (sys.argv[3], len(a), mon))
PY
}

three_runs() { # LABEL PROMPTS ROLLOUT-OPTIONS...: LABEL_RATE_CARRY.jsonl for no monitoring, a quarter apart, carried
  local label=$1 p=$2 run rate carry
  shift 2
  for run in 0:1 0.25:0 0.25:1; do
    rate=${run%:*} carry=${run#*:}
    FR_SHADOW_CARRY=$carry timeout 300 "$bin" rollout --prompts "$p" "$@" --kl-sample-rate $rate --json \
      > "$dir/${label}_${rate}_$carry.jsonl" 2> "$dir/$label.err" ||
      { tail -5 "$dir/$label.err"; fail "$label rollout at rate $rate"; }
  done
}

identical() { # A.jsonl B.jsonl LABEL: the same samples, tokens, log-probs and divergence figures
  $py - "$@" <<'PY' || fail "$3: results differ"
import json, sys
load = lambda f: {(j["request_id"], j["sample"]): j for j in map(json.loads, open(f))}
a, b = load(sys.argv[1]), load(sys.argv[2])
assert a.keys() == b.keys() and a, "different samples"
for k in a:
    for f in ("token_ids", "logprobs", "kl_mean", "kl_max", "top1_agreement"):
        assert a[k].get(f) == b[k].get(f), "%s differs at %s" % (f, k)
mon = sum("kl_mean" in j for j in a.values())
assert mon > 0, "nothing monitored"
print("%s: %d samples, %d monitored, identical" % (sys.argv[3], len(a), mon))
PY
}

q4b=(--model synthetic:qwen3-4b --backend cuda --kv nvfp4 --n 4 --max-tokens 48 --temperature 1 --seed 5
     --ignore-eos --max-seqs 32)
prompts "$dir/p4b.txt" 8 151000 151643
three_runs q4b "$dir/p4b.txt" "${q4b[@]}"
same_generation "$dir/q4b_0_1.jsonl" "$dir/q4b_0.25_0.jsonl" "$name: qwen3-4b shape, shadow apart"
close_generation "$dir/q4b_0.25_0.jsonl" "$dir/q4b_0.25_1.jsonl" "$name: qwen3-4b shape, shadow carried" 0
FR_RIDER_SIDE=0 timeout 300 "$bin" rollout --prompts "$dir/p4b.txt" "${q4b[@]}" --kl-sample-rate 0.25 --json \
  > "$dir/q4b_noside.jsonl" 2> "$dir/q4b.err" || { tail -5 "$dir/q4b.err"; fail "q4b rollout with FR_RIDER_SIDE=0"; }
identical "$dir/q4b_noside.jsonl" "$dir/q4b_0.25_1.jsonl" "$name: qwen3-4b shape, carried shadow's side stream"

# The sampling options (docs/sampling.md) on CUDA, Qwen3-4B shape, greedy.
opt=(--model synthetic:qwen3-4b --backend cuda --kv nvfp4 --n 2 --max-tokens 24 --greedy --max-seqs 32
     --prompts "$dir/p4b.txt" --json)
timeout 300 "$bin" rollout "${opt[@]}" --ignore-eos > "$dir/o_plain.jsonl" 2> "$dir/o.err" || { tail -5 "$dir/o.err"; fail "options: plain"; }
timeout 300 "$bin" rollout "${opt[@]}" --ignore-eos --logprobs 5 --prompt-logprobs > "$dir/o_top.jsonl" 2> "$dir/o.err" ||
  { tail -5 "$dir/o.err"; fail "options: --logprobs"; }
stops=$($py -c 'import json, sys; print(",".join(sorted({str(json.loads(l)["token_ids"][0]) for l in open(sys.argv[1])})))' "$dir/o_plain.jsonl")
timeout 300 "$bin" rollout "${opt[@]}" --stop-ids "$stops" --min-tokens 8 > "$dir/o_min.jsonl" 2> "$dir/o.err" ||
  { tail -5 "$dir/o.err"; fail "options: --min-tokens"; }
$py - "$dir" "$stops" <<'PY' || fail "the sampling options on CUDA"
import json, math, sys
d, stops = sys.argv[1], {int(x) for x in sys.argv[2].split(",")}
load = lambda f: {(j["request_id"], j["sample"]): j for j in map(json.loads, open(d + "/" + f))}
plain, top, mn = load("o_plain.jsonl"), load("o_top.jsonl"), load("o_min.jsonl")
prompts = [l.count(",") + 1 for l in open(d + "/p4b.txt")]
assert plain.keys() == top.keys() == mn.keys()
for k, a in plain.items():
    b = top[k]
    assert a["token_ids"] == b["token_ids"], ("--logprobs changed greedy tokens", k)
    assert all(abs(x - y) <= 1e-5 * max(1, abs(x)) for x, y in zip(a["logprobs"], b["logprobs"])), k
    for t, lp, pairs in zip(b["token_ids"], b["logprobs"], b["top_logprobs"]):
        assert len(pairs) == 5 and pairs[0] == [t, lp], (k, t, pairs[0])
    assert ("prompt_logprobs" in b) == (k[1] == 0), k
    if k[1] == 0:
        plp = b["prompt_logprobs"]
        assert len(plp) == prompts[k[0]] and plp[0] is None and all(math.isfinite(x) and x <= 0 for x in plp[1:]), k
    assert not stops & set(mn[k]["token_ids"][:8]), ("a stop id inside --min-tokens", k)
print("scheduler_gpu: options on CUDA: %d samples, top and prompt log-probs, min_tokens as on the CPU" % len(plain))
PY

# Text through Qwen3's tokenizer on the Qwen3-4B shape: generate's text is its tokens decoded.
qwen=${FR_TOKENIZERS_DIR:-../shared/tokenizers}/qwen3
if [ -f "$qwen/tokenizer.json" ]; then
  timeout 300 "$bin" generate --model synthetic:qwen3-4b --backend cuda --kv nvfp4 --tokenizer "$qwen" \
    --prompt "Bonjour, 世界 ✅" --max-tokens 24 --temperature 1 --seed 3 --json > "$dir/q_text.json" 2> "$dir/q_text.err" ||
    { tail -5 "$dir/q_text.err"; fail "generate with Qwen3's tokenizer"; }
  ids=$($py -c 'import json, sys; print(",".join(map(str, json.load(open(sys.argv[1]))["token_ids"])))' "$dir/q_text.json")
  "$bin" detokenize --tokenizer "$qwen" --ids "$ids" --skip-special > "$dir/q_detok.txt" || fail "detokenize"
  $py - "$dir/q_text.json" "$dir/q_detok.txt" <<'PY' || fail "generate's text on CUDA is not its tokens decoded"
import json, sys
text = json.load(open(sys.argv[1]))["text"]
want = open(sys.argv[2], encoding="utf-8", newline="").read()[:-1]   # detokenize ends with a newline
assert text == want, (text, want)
print("scheduler_gpu: Qwen3's tokenizer on CUDA: %d characters of text equal the decode" % len(text))
PY
else
  echo "$name: $qwen not found: the Qwen3 tokenizer case skipped"
fi

tq6=$(cd "${FR_TQ6_DIR:-../shared/models/tq6}" 2>/dev/null && pwd || true)
if [ -z "$tq6" ] || [ ! -f "$tq6/config.json" ]; then
  echo "$name: tq6 not found: its cases skipped"
  echo "$name: PASS"
  exit 0
fi
prompts "$dir/ptq6.txt" 12 256 256
t6=(--model "$tq6" --backend cuda --kv nvfp4 --n 3 --max-tokens 96 --temperature 1 --seed 2 --ignore-eos --max-seqs 16)
three_runs tq6 "$dir/ptq6.txt" "${t6[@]}"
same_generation "$dir/tq6_0_1.jsonl" "$dir/tq6_0.25_0.jsonl" "$name: tq6, shadow apart"
close_generation "$dir/tq6_0.25_0.jsonl" "$dir/tq6_0.25_1.jsonl" "$name: tq6, shadow carried" 0.75

# Greedy: the scheduler against generate, prompt by prompt.
timeout 300 "$bin" rollout --prompts "$dir/ptq6.txt" --model "$tq6" --backend cuda --kv nvfp4 --greedy --max-tokens 64 \
  --ignore-eos --max-seqs 16 --json > "$dir/greedy_rollout.jsonl" 2> "$dir/greedy_rollout.err" ||
  { tail -5 "$dir/greedy_rollout.err"; fail "greedy rollout"; }
i=0
while IFS= read -r line; do
  echo "$line" > "$dir/one.txt"
  timeout 120 "$bin" generate --model "$tq6" --backend cuda --kv nvfp4 --prompt-file "$dir/one.txt" --max-tokens 64 \
    --ignore-eos --json > "$dir/gen_$i.json" 2> "$dir/gen_$i.err" || { tail -5 "$dir/gen_$i.err"; fail "generate $i"; }
  i=$((i + 1))
done < "$dir/ptq6.txt"
$py - "$dir" $i <<'PY' || fail "greedy scheduler tokens differ from generate's"
import json, sys
d, n = sys.argv[1], int(sys.argv[2])
roll = {j["request_id"]: j["token_ids"] for j in map(json.loads, open(d + "/greedy_rollout.jsonl"))}
bad = 0
for i in range(n):
    g = json.loads(open("%s/gen_%d.json" % (d, i)).read().splitlines()[0])
    toks = g["token_ids"] if "token_ids" in g else g["samples"][0]["token_ids"]
    if toks != roll[i]:
        bad += 1
        k = next(t for t in range(len(toks)) if toks[t] != roll[i][t])
        print("prompt %d: first difference at token %d" % (i, k))
print("scheduler_gpu: greedy, %d of %d prompts equal to generate" % (n - bad, n))
sys.exit(1 if bad else 0)
PY

# Stop strings on CUDA: one taken from prompt 0's greedy text ends every
# sample whose text holds it, at the token that completes it.
stop=$($py -c '
import json, sys
t = json.loads(open(sys.argv[1]).readline())["text"]
s = next(t[i:i + 3] for i in range(len(t) // 3, len(t) - 3) if "\ufffd" not in t[i:i + 3] and "\0" not in t[i:i + 3])
print(json.dumps(s))' "$dir/greedy_rollout.jsonl")
stop=$($py -c 'import json, sys; print(json.loads(sys.argv[1]), end="")' "$stop")
timeout 300 "$bin" rollout --prompts "$dir/ptq6.txt" --model "$tq6" --backend cuda --kv nvfp4 --greedy --max-tokens 64 \
  --ignore-eos --max-seqs 16 --json --stop "$stop" > "$dir/stop_rollout.jsonl" 2> "$dir/stop_rollout.err" ||
  { tail -5 "$dir/stop_rollout.err"; fail "rollout with a stop string"; }
$py - "$dir/stop_rollout.jsonl" "$stop" <<'PY' || fail "stop strings on CUDA"
import json, sys
stop, stopped = sys.argv[2], 0
decode = lambda ids: bytes(t for t in ids if t < 256).decode("utf-8", "replace")   # tq6 is byte-level
for j in map(json.loads, open(sys.argv[1])):
    whole = decode(j["token_ids"])
    if j["finish_reason"] == "stop":
        stopped += 1
        assert j["stop_str"] == stop and stop not in j["text"], j
        assert whole.startswith(j["text"] + stop) and stop not in decode(j["token_ids"][:-1]), j
    else:
        assert stop not in whole and j["text"] == whole, j
assert stopped >= 1, "the sample the stop string came from did not stop"
print("scheduler_gpu: stop string %r on CUDA: %d samples stopped where it completed" % (stop, stopped))
PY
echo "$name: PASS"
