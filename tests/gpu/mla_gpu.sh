#!/usr/bin/env bash
# Multi-head latent attention (tqa, DeepSeek-V3 style) on the CUDA backend,
# every check in one go (docs/mla.md):
#  1. test_mla_store: latent pages, slots and staging rows the GPU writes
#     against the CPU cache's, byte for byte (every latent dtype, full
#     recipe, vanilla and ablations, tqa's and DeepSeek-V3's rows);
#  2. test_mla_gpu: tqa on CUDA against the CPU backend (logits at BF16
#     level on the golden prompts, greedy continuations through the decode
#     graphs, forks, refusals);
#  3. generate --greedy on p3 with --backend cuda equals --backend cpu (bf16
#     and nvfp4 latent caches);
#  4. calibrate --backend cuda on tq6's calibration texts: its latent mean
#     and FP8 scales within BF16 level of --backend cpu's;
#  5. eval-kl --backend cuda on 8 x 4096 positions of tq6's eval texts with
#     that calibration: every row of tqa's README reference table within
#     +-30% (KL and top-1 mismatch printed, KL checked).
# Tensor parallelism on two GPUs: tests/gpu/tp_gpu.sh (it runs tqa too).
# Needs tqa ($FR_TQA_DIR or ../shared/models/tqa), tq6's texts
# ($FR_TQ6_DIR/texts or ../shared/models/tq6/texts) and one GPU.
# usage: tests/gpu/mla_gpu.sh [BUILD_DIR]
set -euo pipefail
name=mla_gpu
build=${1:-${BUILD:-build}}
bin=$build/fp4rollout
py=${PYTHON:-python3}
tqa=${FR_TQA_DIR:-../shared/models/tqa}
texts=${FR_TQ6_DIR:-../shared/models/tq6}/texts
fail() { echo "$name: FAIL: $*" >&2; exit 1; }
[ -x "$bin" ] || fail "$bin is missing (run make)"
[ -f "$tqa/golden.safetensors" ] || { echo "$name: SKIP: tqa not found (set FR_TQA_DIR)"; exit 0; }
nvidia-smi -L >/dev/null 2>&1 || { echo "$name: SKIP: no GPU"; exit 0; }
export FR_TQA_DIR=$tqa
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

echo "== 1. latent pages byte for byte"
"$build/gpu/test_mla_store" || fail "test_mla_store"
echo "== 2. tqa on CUDA against the CPU"
"$build/gpu/test_mla_gpu" || fail "test_mla_gpu"

echo "== 3. generate --greedy, cuda against cpu"
$py - "$tqa/golden.safetensors" "$dir/p3.txt" <<'PY'
import json, struct, sys
with open(sys.argv[1], 'rb') as f:
    n = struct.unpack('<Q', f.read(8))[0]
    meta = json.loads(f.read(n))
    a, b = meta['p3.ids']['data_offsets']
    f.seek(8 + n + a)
    raw = f.read(b - a)
ids = struct.unpack('<%di' % (len(raw) // 4), raw)
open(sys.argv[2], 'w').write(','.join(map(str, ids)))
PY
for kv in bf16 nvfp4; do
  g=(generate --model "$tqa" --prompt-file "$dir/p3.txt" --greedy --max-tokens 64 --kv "$kv" --fp4-compute bf16 --json)
  "$bin" "${g[@]}" --backend cpu > "$dir/g_cpu.json"
  "$bin" "${g[@]}" --backend cuda > "$dir/g_gpu.json"
  $py - "$dir/g_cpu.json" "$dir/g_gpu.json" "$kv" <<'PY' || fail "generate --kv $kv: the GPU's greedy tokens differ"
import json, sys
a, b = (json.loads(open(p).readline())["token_ids"] for p in sys.argv[1:3])
same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
print("generate p3 --kv %s: %d of %d greedy tokens equal" % (sys.argv[3], same, len(a)))
sys.exit(0 if a == b else 1)
PY
done

echo "== 4. calibrate --backend cuda against --backend cpu"
calib_texts=("$texts"/calib_0.txt "$texts"/calib_1.txt "$texts"/calib_2.txt "$texts"/calib_3.txt)
"$bin" calibrate --model "$tqa" --backend cuda --texts "${calib_texts[@]}" --out "$dir/calib_gpu.safetensors"
"$bin" calibrate --model "$tqa" --backend cpu --texts "${calib_texts[@]}" --out "$dir/calib_cpu.safetensors"
$py - "$dir/calib_cpu.safetensors" "$dir/calib_gpu.safetensors" <<'PY' || fail "the GPU's calibration differs from the CPU's"
import json, struct, sys
def read(p):
    with open(p, 'rb') as f:
        n = struct.unpack('<Q', f.read(8))[0]
        meta = json.loads(f.read(n))
        out = {}
        for k, v in meta.items():
            if k == '__metadata__' or v['dtype'] != 'F32':
                continue
            a, b = v['data_offsets']
            f.seek(8 + n + a)
            raw = f.read(b - a)
            out[k] = struct.unpack('<%df' % (len(raw) // 4), raw)
        return out
c, g = read(sys.argv[1]), read(sys.argv[2])
ok = True
for k in ('key_mean', 'fp8_scales'):
    if k not in c or k not in g:
        print("missing %s" % k); ok = False; continue
    top = max(abs(x) for x in c[k]) or 1.0
    d = max(abs(x - y) for x, y in zip(c[k], g[k]))
    print("calibration %s: GPU vs CPU max |diff| %.4g (%.3g of max %.4g)" % (k, d, d / top, top))
    ok = ok and d <= 0.05 * top
sys.exit(0 if ok else 1)
PY

echo "== 5. eval-kl --backend cuda against tqa's reference table"
configs=fp8,nvfp4-vanilla,nvfp4,nvfp4-no-smooth,nvfp4-no-rotate,nvfp4-no-search,nvfp4-no-dual,nvfp4-no-sink,nvfp4-kv,mxfp4-vanilla,mxfp4,mxfp4-kv
"$bin" eval-kl --model "$tqa" --backend cuda --calib "$dir/calib_gpu.safetensors" --tokens 4096 --json --quiet \
  --texts "$texts"/eval_0.txt "$texts"/eval_1.txt "$texts"/eval_2.txt "$texts"/eval_3.txt \
          "$texts"/eval_4.txt "$texts"/eval_5.txt "$texts"/eval_6.txt "$texts"/eval_7.txt \
  --configs "$configs" > "$dir/kl.json"
$py - "$dir/kl.json" <<'PY' || fail "eval-kl --backend cuda: rows outside +-30% of the reference"
import json, sys
# tqa's README: KL (1e-3 nats), top-1 mismatch %
ref = {"fp8": (0.389, 0.94), "nvfp4-vanilla": (4.03, 2.79), "nvfp4": (0.816, 1.14),
       "nvfp4-no-smooth": (0.956, 1.23), "nvfp4-no-rotate": (0.833, 1.12), "nvfp4-no-search": (1.051, 1.40),
       "nvfp4-no-dual": (1.291, 1.50), "nvfp4-no-sink": (2.161, 1.97), "nvfp4-kv": (0.806, 1.18),
       "mxfp4-vanilla": (10.98, 4.39), "mxfp4": (1.970, 1.73), "mxfp4-kv": (1.940, 1.72)}
bad = []
print("%-16s %9s %9s %7s %9s %9s" % ("config", "KL", "ref KL", "ratio", "top-1 %", "ref %"))
for line in open(sys.argv[1]):
    r = json.loads(line)
    k, m = r["kl_1e3"], r["top1_mismatch_pct"]
    rk, rm = ref[r["config"]]
    print("%-16s %9.4g %9.4g %7.2f %9.3g %9.3g" % (r["config"], k, rk, k / rk, m, rm))
    if not (0.7 * rk <= k <= 1.3 * rk):
        bad.append(r["config"])
if bad:
    print("outside +-30%: " + ", ".join(bad))
sys.exit(1 if bad else 0)
PY
echo "$name: all checks passed"
