#!/usr/bin/env bash
# Black-box checks of `fp4rollout calibrate` and `fp4rollout eval-kl` on the
# built-in synthetic model: a calibration file from two small texts, loaded
# by eval-kl, generate and score; eval-kl's JSON; clear errors for bad input;
# both commands on the Mixture-of-Experts checkpoint tqm and the latent
# attention checkpoint tqa when present.
set -euo pipefail
name=cli_calibrate_eval
source "$(dirname "$0")/cli_setup.bash"

$py - "$dir" <<'PY'
import random, sys
random.seed(3)
words = "def class return import self value index table lookup print for while if else".split()
for i in range(3):
    text = " ".join(random.choice(words) for _ in range(80)) + "\n"
    open(f"{sys.argv[1]}/t{i}.txt", "w").write(text)
PY

# calibrate: small window, short seeds and continuation
"$bin" calibrate --model synthetic:tiny --texts "$dir/t0.txt" "$dir/t1.txt" --context 400 --seed-tokens 100 \
  --continue 16 --tau-steps 8 --chunk 128 --out "$dir/calib.safetensors" > "$dir/cal.out" 2> "$dir/cal.err" ||
  fail "calibrate failed: $(cat "$dir/cal.err")"
[ -s "$dir/calib.safetensors" ] || fail "no calibration file"
grep -q "calibration written to" "$dir/cal.out" || fail "calibrate summary missing"
grep -q "tau: code" "$dir/cal.out" || fail "calibrate does not report tau"
grep -q "prefill" "$dir/cal.err" || fail "calibrate shows no progress on stderr"
$py - "$dir/calib.safetensors" <<'PY' || fail "calibration file malformed"
import json, math, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr = json.loads(raw[8:8 + n])
data = raw[8 + n:]
assert hdr["key_mean"]["shape"] == [2, 2, 64], hdr["key_mean"]
assert hdr["tau"]["shape"] == [1] and hdr["fp8_scales"]["shape"] == [2, 2, 2]
a, b = hdr["tau"]["data_offsets"]
tau = struct.unpack("<f", data[a:b])[0]
assert 0 < tau < 6, tau
a, b = hdr["fp8_scales"]["data_offsets"]
assert all(s > 0 and math.isfinite(s) for s in struct.unpack(f"<{(b - a) // 4}f", data[a:b]))
assert max(e for _, e in (t["data_offsets"] for t in hdr.values())) == len(data)
PY

# the file loads wherever --calib is accepted
"$bin" generate --model synthetic:tiny --kv nvfp4 --calib "$dir/calib.safetensors" --max-tokens 8 --json > /dev/null ||
  fail "generate --calib failed"
"$bin" score --model synthetic:tiny --kv fp8 --calib "$dir/calib.safetensors" --prompt-ids 256,1,2,3 --decode \
  --out "$dir/s.f32" || fail "score --calib failed"

# eval-kl with the calibration, JSON out
"$bin" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" "$dir/t2.txt" --calib "$dir/calib.safetensors" \
  --configs bf16,fp8,nvfp4,nvfp4-vanilla,mxfp4-kv --tokens 160 --json > "$dir/kl.jsonl" 2> "$dir/kl.err" ||
  fail "eval-kl failed: $(cat "$dir/kl.err")"
$py - "$dir/kl.jsonl" <<'PY' || fail "eval-kl JSON malformed or implausible"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert [r["config"] for r in rows] == ["bf16", "fp8", "nvfp4", "nvfp4-vanilla", "mxfp4-kv"], rows
for r in rows:
    assert r["texts"] == 2 and r["positions"] == 320, r
    assert len(r["text_kl_1e3"]) == 2 and len(r["text_top1_mismatch_pct"]) == 2
    assert r["kl_1e3"] >= 0 and 0 <= r["top1_mismatch_pct"] <= 100
    assert r["calib"].endswith("calib.safetensors")
bf16, fp8, nv, van, mxkv = rows
assert bf16["kl_1e3"] == 0 and bf16["top1_mismatch_pct"] == 0
assert nv["kl_1e3"] > 0 and van["kl_1e3"] > 0 and fp8["kl_1e3"] > 0
assert nv["baseline"] == "nvfp4" and nv["t_text"] is None and van["baseline"] == "nvfp4"
assert mxkv["kv"] == "mxfp4" and mxkv["compute"] == "bf16" and mxkv["baseline"] == "mxfp4-kv"
PY

# --deterministic: text 1's figures alone (one BLAS thread) equal those
# beside text 2 (four threads) in the JSON; the CUDA backend refuses it.
det=(eval-kl --model synthetic:tiny --calib "$dir/calib.safetensors" --configs fp8,nvfp4 --tokens 120 --json --quiet
     --deterministic)
OPENBLAS_NUM_THREADS=4 "$bin" "${det[@]}" --texts "$dir/t1.txt" "$dir/t2.txt" > "$dir/d2.jsonl" 2> "$dir/d.err" ||
  fail "eval-kl --deterministic failed: $(cat "$dir/d.err")"
OPENBLAS_NUM_THREADS=1 "$bin" "${det[@]}" --texts "$dir/t1.txt" > "$dir/d1.jsonl" 2> "$dir/d.err" ||
  fail "eval-kl --deterministic failed: $(cat "$dir/d.err")"
$py - "$dir/d1.jsonl" "$dir/d2.jsonl" <<'PY' || fail "eval-kl --deterministic: text 1 alone differs from beside text 2"
import json, sys
alone, both = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
for a, b in zip(alone, both):
    assert a["config"] == b["config"] and a["text_kl_1e3"][0] == b["text_kl_1e3"][0] != 0, (a, b)
    assert a["text_top1_mismatch_pct"][0] == b["text_top1_mismatch_pct"][0], (a, b)
PY

# the table, the ablation list, and the warning without --calib
"$bin" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" --tokens 40 --ablation --quiet > "$dir/abl.txt" \
  2> "$dir/abl.err" || fail "eval-kl --ablation failed"
for c in nvfp4 nvfp4-no-smooth nvfp4-no-rotate nvfp4-no-search nvfp4-no-dual nvfp4-no-pscale nvfp4-no-sink; do
  grep -q "^| $c |" "$dir/abl.txt" || fail "ablation table lacks $c"
done
grep -q "warning: no --calib" "$dir/abl.err" || fail "no warning without --calib"

expect_error() {
  local pattern=$1; shift
  if "$bin" "$@" >/dev/null 2>"$dir/err"; then fail "accepted: $*"; fi
  grep -q -- "$pattern" "$dir/err" || fail "message for '$*' lacks '$pattern': $(cat "$dir/err")"
}
expect_error "--model is required" calibrate --texts "$dir/t0.txt" --out "$dir/x.safetensors"
expect_error "--texts needs at least one file" calibrate --model synthetic:tiny --out "$dir/x.safetensors"
expect_error "--out is required" calibrate --model synthetic:tiny --texts "$dir/t0.txt"
expect_error "cannot read text file" calibrate --model synthetic:tiny --texts "$dir/missing.txt" --out "$dir/x.safetensors"
expect_error "--kv must be bf16 or f32" calibrate --model synthetic:tiny --texts "$dir/t0.txt" --kv nvfp4 --out "$dir/x.safetensors"
expect_error "--continue expects" calibrate --model synthetic:tiny --texts "$dir/t0.txt" --continue -1 --out "$dir/x.safetensors"
expect_error "context" calibrate --model synthetic:tiny --texts "$dir/t0.txt" --context 99999 --out "$dir/x.safetensors"
expect_error "unknown or ambiguous option" calibrate --model synthetic:tiny --bogus
[ -e "$dir/x.safetensors" ] && fail "a failed calibrate left an output file"
expect_error "unknown configuration 'nvfp5'" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" --configs nvfp4,nvfp5
expect_error "unknown recipe switch" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" --configs nvfp4-no-magic
expect_error "--tokens expects" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" --tokens 0
expect_error "--texts needs at least one file" eval-kl --model synthetic:tiny
expect_error "--deterministic runs on the CPU backend only" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" \
  --backend cuda --deterministic
expect_error "cannot read text file" eval-kl --model synthetic:tiny --texts "$dir/missing.txt"
expect_error "t0.txt: header length" eval-kl --model synthetic:tiny --texts "$dir/t1.txt" --calib "$dir/t0.txt"
# A Mixture-of-Experts checkpoint (tqm) through both commands: calibrate and
# a short teacher-forced evaluation; the recipe must stay well below vanilla.
tqm=${FR_TQM_DIR:-../shared/models/tqm}
if [ -f "$tqm/config.json" ]; then
  "$bin" calibrate --model "$tqm" --texts "$dir/t0.txt" "$dir/t1.txt" --context 400 --seed-tokens 100 \
    --continue 16 --tau-steps 8 --chunk 128 --out "$dir/tqm.safetensors" > /dev/null 2> "$dir/cal.err" ||
    fail "calibrate on tqm failed: $(cat "$dir/cal.err")"
  "$bin" eval-kl --model "$tqm" --texts "$dir/t0.txt" "$dir/t1.txt" --calib "$dir/tqm.safetensors" --tokens 400 \
    --configs nvfp4,nvfp4-vanilla --quiet --json > "$dir/tqm.json" 2> "$dir/ev.err" ||
    fail "eval-kl on tqm failed: $(cat "$dir/ev.err")"
  $py - "$dir/tqm.json" <<'PY' || fail "eval-kl on tqm: unexpected figures: $(cat "$dir/tqm.json")"
import json, sys
rows = {r["config"]: r for r in map(json.loads, open(sys.argv[1]))}
full, vanilla = rows["nvfp4"]["kl_1e3"], rows["nvfp4-vanilla"]["kl_1e3"]
print("tqm eval-kl: nvfp4 %.3f, nvfp4-vanilla %.3f (1e-3 nats)" % (full, vanilla))
sys.exit(0 if 0 < full < vanilla / 3 else 1)
PY
else
  echo "cli_calibrate_eval: SKIP tqm part: checkpoint not found (set FR_TQM_DIR or place it at ../shared/models/tqm)"
fi

# A latent attention checkpoint (tqa, paper Appendix G): calibrate measures
# the latent mean (RoPE part zero), eval-kl runs every latent dtype and recipe
# switch on the first 260 tokens of a real text (one FP4 page, then the BF16
# recent slot), with figures in the range of tqa's README table.
tqa=${FR_TQA_DIR:-../shared/models/tqa}
texts=$tqa/../tq6/texts
if [ -f "$tqa/config.json" ] && [ -f "$texts/calib_0.txt" ] && [ -f "$texts/eval_0.txt" ]; then
  export OPENBLAS_NUM_THREADS=1   # small matrices: threads only cost time here
  "$bin" calibrate --model "$tqa" --texts "$texts/calib_0.txt" "$texts/calib_1.txt" --context 400 --seed-tokens 100 \
    --continue 16 --tau-steps 8 --chunk 128 --out "$dir/tqa.safetensors" > "$dir/tqa_cal.out" 2> "$dir/cal.err" ||
    fail "calibrate on tqa failed: $(cat "$dir/cal.err")"
  grep -q "latent mean (256 channels" "$dir/tqa_cal.out" || fail "calibrate on tqa: no latent mean reported"
  $py - "$dir/tqa.safetensors" <<'PY' || fail "tqa calibration file: not a latent mean"
import json, struct, sys
raw = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
hdr, data = json.loads(raw[8:8 + n]), raw[8 + n:]
assert hdr["key_mean"]["shape"] == [4, 1, 320] and hdr["fp8_scales"]["shape"] == [4, 1, 2]
a, b = hdr["key_mean"]["data_offsets"]
mu = struct.unpack(f"<{(b - a) // 4}f", data[a:b])
for l in range(4):
    row = mu[l * 320:(l + 1) * 320]
    assert any(x != 0 for x in row[:256]) and all(x == 0 for x in row[256:]), l
PY
  cfgs=bf16,f32,fp8,nvfp4,nvfp4-vanilla,nvfp4-kv,mxfp4,mxfp4-vanilla,mxfp4-kv
  cfgs=$cfgs,nvfp4-no-smooth,nvfp4-no-rotate,nvfp4-no-search,nvfp4-no-dual,nvfp4-no-sink
  "$bin" eval-kl --model "$tqa" --texts "$texts/eval_0.txt" --calib "$dir/tqa.safetensors" --tokens 260 \
    --configs $cfgs --quiet --json > "$dir/tqa.json" 2> "$dir/ev.err" || fail "eval-kl on tqa failed: $(cat "$dir/ev.err")"
  $py - "$dir/tqa.json" <<'PY' || fail "eval-kl on tqa: unexpected figures: $(cat "$dir/tqa.json")"
import json, math, sys
kl = {r["config"]: r["kl_1e3"] for r in map(json.loads, open(sys.argv[1]))}
print("tqa eval-kl (1e-3 nats): " + ", ".join("%s %.3f" % kv for kv in kl.items()))
assert kl["bf16"] == 0 and 0 <= kl["f32"] < 0.1, kl
# README reference (8 x 4096 positions): fp8 0.389, nvfp4 0.816, nvfp4 vanilla
# 4.03, mxfp4 1.970, mxfp4 vanilla 10.98; here one short text, so wide bands.
bands = {"fp8": (0.05, 2), "nvfp4": (0.05, 3), "nvfp4-kv": (0.05, 3), "mxfp4": (0.1, 8), "mxfp4-kv": (0.1, 8),
         "nvfp4-vanilla": (1, 30), "mxfp4-vanilla": (3, 80)}
for c, (lo, hi) in bands.items():
    assert lo < kl[c] < hi, (c, kl[c])
assert kl["nvfp4"] < kl["nvfp4-vanilla"] / 3 and kl["mxfp4"] < kl["mxfp4-vanilla"] / 3, kl
for c in ("smooth", "rotate", "search", "dual", "sink"):   # every switch runs and stays below vanilla
    v = kl["nvfp4-no-" + c]
    assert math.isfinite(v) and 0 < v < kl["nvfp4-vanilla"], (c, v)
assert kl["nvfp4-no-sink"] > kl["nvfp4"], kl   # every token FP4: worse
PY
  unset OPENBLAS_NUM_THREADS
else
  echo "cli_calibrate_eval: SKIP tqa part: checkpoint or ../tq6/texts not found (set FR_TQA_DIR or place it at ../shared/models/tqa)"
fi

for c in calibrate eval-kl; do { out=$("$bin" $c --help) && grep -q "usage: fp4rollout $c" <<< "$out"; } || fail "$c --help"; done
{ out=$("$bin" --help) && grep -q "eval-kl" <<< "$out"; } || fail "eval-kl missing from the command list"
echo "cli_calibrate_eval: all checks passed"
