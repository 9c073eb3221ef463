#!/usr/bin/env bash
# Tensor parallelism on the CUDA backend over NCCL (docs/tensor_parallel.md):
# the same tq6 job at --tp 1 on one GPU and at --tp 2 under mpirun on two.
#  - golden prompt p3 (511 tokens): prefill logits at tp 2 against tp 1
#    within 2e-2 x max |logit|, printed beside the BF16 engine's own
#    distance from the float32 golden logits (the scale of BF16 rounding);
#  - the nvfp4 decode path: tp 2 against tp 1 at most half the FP4 error
#    itself (nvfp4 against bf16 KV at tp 1) on average, top-1 agreement on
#    99% of positions. The all-reduce sums the ranks' partial products in
#    another order, the BF16 activations round a few values the other way,
#    and the FP4 cache turns those into whole-code differences: the same
#    noise the CUDA and CPU backends show against each other on the same
#    FP4 path (docs/tensor_parallel.md has the figures);
#  - generate --greedy --max-tokens 32: the same tokens;
# then the same on the Mixture-of-Experts tqm ($FR_TQM_DIR) and the latent
# attention tqa ($FR_TQA_DIR) when present, and DeepSeek's mixture of
# experts on the tiny DeepSeek models (prefill of a prompt at tp 2 within
# 2e-2 x max |logit| of tp 1: the shared experts' and every expert's rows
# split, the router and its bias whole).
# Needs two GPUs, mpirun and tq6 ($FR_TQ6_DIR or ../shared/models/tq6);
# skipped with a message otherwise.
# usage: tests/gpu/tp_gpu.sh [BUILD_DIR]
set -euo pipefail
name=tp_gpu
bin=${1:-${BUILD:-build}}/fp4rollout
py=${PYTHON:-python3}
tq6=${FR_TQ6_DIR:-../shared/models/tq6}
fail() { echo "$name: FAIL: $*" >&2; exit 1; }
[ -x "$bin" ] || fail "$bin is missing (run make)"
if ! command -v mpirun >/dev/null 2>&1; then echo "$name: SKIP: mpirun not found"; exit 0; fi
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -lt 2 ]; then echo "$name: SKIP: fewer than two GPUs"; exit 0; fi
if [ ! -f "$tq6/golden.safetensors" ]; then echo "$name: SKIP: tq6 not found"; exit 0; fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
export NCCL_NVLS_ENABLE=0
mpi=(mpirun --oversubscribe -x NCCL_NVLS_ENABLE -x LD_LIBRARY_PATH -np 2)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
run2() { timeout 300 "${mpi[@]}" "$bin" "$@"; }

# check_model DIR LABEL: the checks above on one checkpoint.
check_model() {
  local model=$1 label=$2
  $py - "$model/golden.safetensors" "$dir" <<'PY'
import json, struct, sys
with open(sys.argv[1], 'rb') as f:
    n = struct.unpack('<Q', f.read(8))[0]
    meta = json.loads(f.read(n))
    def tensor(name):
        a, b = meta[name]['data_offsets']
        f.seek(8 + n + a)
        return f.read(b - a)
    ids = struct.unpack('<511i', tensor('p3.ids'))
    open(sys.argv[2] + '/p3.txt', 'w').write(','.join(map(str, ids)))
    open(sys.argv[2] + '/golden.f32', 'wb').write(tensor('p3.logits_f32'))
PY
  m=(--model "$model" --backend cuda --prompt-file "$dir/p3.txt")
  "$bin" score "${m[@]}" --out "$dir/p1.f32"
  run2 score --tp 2 "${m[@]}" --out "$dir/p2.f32"
  "$bin" score "${m[@]}" --decode --kv bf16 --out "$dir/b1.f32"
  "$bin" score "${m[@]}" --decode --kv nvfp4 --out "$dir/n1.f32"
  run2 score --tp 2 "${m[@]}" --decode --kv nvfp4 --out "$dir/n2.f32"
  $py - "$dir" "$label" <<'PY' || fail "$label: tp 2 differs from tp 1 beyond the bounds"
import array, sys
d = sys.argv[1]
def read(p):
    a = array.array('f')
    with open(d + '/' + p, 'rb') as f:
        a.frombytes(f.read())
    return a
V = 272
p1, p2, gold, b1, n1, n2 = (read(p) for p in ('p1.f32', 'p2.f32', 'golden.f32', 'b1.f32', 'n1.f32', 'n2.f32'))
top = max(abs(x) for x in p1)
tp = max(abs(x - y) for x, y in zip(p1, p2))
bf = max(abs(x - y) for x, y in zip(p1, gold))
print(sys.argv[2] + " prefill p3: tp 2 vs tp 1 max |diff| %.4g (%.3g of max |logit| %.3g); tp 1 vs float32 golden %.4g (%.3g)"
      % (tp, tp / top, top, bf, bf / top))
ok = tp <= 2e-2 * top
rows = len(n1) // V
tp_d = [abs(x - y) for x, y in zip(n1, n2)]
q_e = [abs(x - y) for x, y in zip(n1, b1)]
argmax = lambda a, r: max(range(V), key=lambda i: a[r * V + i])
agree = sum(argmax(n1, r) == argmax(n2, r) for r in range(rows))
mt, mq = sum(tp_d) / len(tp_d), sum(q_e) / len(q_e)
print(sys.argv[2] + " decode p3, nvfp4 KV: tp 2 vs tp 1 max |diff| %.4g (%.3g of max |logit|), mean %.4g = %.3g x the mean "
      "FP4 error (nvfp4 vs bf16 KV) %.4g; top-1 agreement %d/%d" % (max(tp_d), max(tp_d) / top, mt, mt / mq, mq,
      agree, rows))
ok = ok and max(tp_d) <= 0.05 * top and mt <= 0.5 * mq and agree >= 0.99 * rows
sys.exit(0 if ok else 1)
PY
  g=(generate --model "$model" --backend cuda --prompt-file "$dir/p3.txt" --greedy --max-tokens 32 --json)
  "$bin" "${g[@]}" > "$dir/q1.json"
  run2 "${g[@]}" --tp 2 > "$dir/q2.json"
  $py - "$dir/q1.json" "$dir/q2.json" <<'PY' || fail "$label: greedy tokens differ at tp 2"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:3])
if len(b) != 1:
    sys.exit("%d output lines at tp 2: only rank 0 should print" % len(b))
ta, tb = a[0]["token_ids"], b[0]["token_ids"]
same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
print("greedy p3: %d of %d tokens equal before the first difference" % (same, len(ta)))
sys.exit(0 if ta == tb else 1)
PY
}

check_model "$tq6" tq6
# The Mixture-of-Experts tqm: every expert's intermediate rows split, the
# router replicated (docs/tensor_parallel.md); the same bounds.
tqm=${FR_TQM_DIR:-../shared/models/tqm}
if [ -f "$tqm/golden.safetensors" ]; then check_model "$tqm" tqm; else echo "$name: SKIP tqm: not found"; fi
# The latent attention tqa ($FR_TQA_DIR): heads split, the latent cache
# replicated on both GPUs (docs/tensor_parallel.md); the same bounds.
tqa=${FR_TQA_DIR:-../shared/models/tqa}
if [ -f "$tqa/golden.safetensors" ]; then check_model "$tqa" tqa; else echo "$name: SKIP tqa: not found"; fi
# DeepSeek's mixture of experts (docs/deepseek_moe.md) on the tiny models.
for m in tiny-dsmoe tiny-dsmoe-v2; do
  d=(--model "synthetic:$m" --backend cuda --prompt-ids 256,100,101,102,32,102,40,120,41,58,10,32,32,114,101,116)
  "$bin" score "${d[@]}" --out "$dir/$m-1.f32"
  run2 score --tp 2 "${d[@]}" --out "$dir/$m-2.f32"
  $py - "$dir/$m-1.f32" "$dir/$m-2.f32" "$m" <<'PY' || fail "$m: tp 2 differs from tp 1 beyond 2e-2 of max |logit|"
import array, sys
a, b = (array.array('f', open(p, 'rb').read()) for p in sys.argv[1:3])
top, d = max(abs(x) for x in a), max(abs(x - y) for x, y in zip(a, b))
print("%s prefill: tp 2 vs tp 1 max |diff| %.4g (%.3g of max |logit| %.3g)" % (sys.argv[3], d, d / top, top))
sys.exit(0 if len(a) == len(b) and d <= 2e-2 * top else 1)
PY
done
echo "$name: all checks passed"
