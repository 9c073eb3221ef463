#!/usr/bin/env bash
# One DAPO run against a fresh `fp4rollout serve` with a chosen KV cache, or
# the three-run comparison (BF16 KV, NVFP4 full recipe, NVFP4 vanilla).
#
#   examples/dapo/run_experiment.sh KIND OUT [train.py options...]
#   examples/dapo/run_experiment.sh all OUT [train.py options...]
#   examples/dapo/run_experiment.sh fig8 OUT [train.py options...]
#
# KIND: bf16 | fp8 | nvfp4 | nvfp4-vanilla | mxfp4 | mxfp4-vanilla | f32.
# `all` runs bf16, nvfp4 and nvfp4-vanilla one after the other into OUT/KIND
# and then draws OUT/compare.png and prints a markdown table (plot.py).
# `fig8`: the same three on the arithmetic task, resumable, for a sequence
# of time-limited calls: each call spends at most CALL_S seconds (540) on
# the warm-up (sft.py into OUT/sft, SFT_ARGS) until it is done, then on the
# run with the fewest steps; run it again until it says all three are done
# (README.md, "The Figure 8 experiment").
# Run it from the repository root after `make`.
#
# Environment: MODEL (checkpoint folder, default ../shared/models/tq6),
# BACKEND (auto: the GPU when there is one), MAX_SEQS (64), PORT (a free
# loopback port), METRICS_PORT (0: off), CALIB (auto: for FP8 and
# full-recipe FP4 kinds, calibrate once into OUT/calib.safetensors from
# MODEL/texts/calib_*.txt when those exist; none: no calibration file; or a
# file), BUILD (build), PYTHON (the interpreter with PyTorch, default
# /usr/bin/python3), KV_BLOCKS (KV pages; default: sized by the CPU
# backend itself, else MAX_SEQS x 16), DEADLINE (epoch seconds: the trainer
# stops before a step that would end past it, less 30 s; fig8 sets it),
# fig8 only: CALL_S, SFT_ARGS, OPERANDS (8), DIGITS (20), DEVICE (cuda when
# nvidia-smi works, else cpu), MIN_LEFT (150: seconds a call needs left to
# start another run), PARALLEL (1 on a GPU: the three runs at once; 0 on the
# CPU: one after another).
# The server's own log goes to OUT/serve.log; a run into a folder that holds
# OUT/calib.safetensors reuses it.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=${BUILD:-build}
bin=$build/fp4rollout
py=${PYTHON:-/usr/bin/python3}
[ $# -ge 2 ] || { sed -n '2,33p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
kind=$1; out=$2; shift 2
[ -x "$bin" ] || { echo "run_experiment: $bin is missing (run make)" >&2; exit 1; }

if [ "$kind" = all ]; then
  for k in bf16 nvfp4 nvfp4-vanilla; do
    "$0" "$k" "$out/$k" "$@"
  done
  $py "$here/plot.py" --compare "$out/bf16" "$out/nvfp4" "$out/nvfp4-vanilla" \
    --labels "BF16 KV,NVFP4 KV (full recipe),NVFP4 KV (vanilla)" --smooth 5 --out "$out/compare.png" \
    | tee "$out/compare.md"
  exit 0
fi
if [ "$kind" = fig8 ]; then
  exec bash "$here/fig8.sh" "$out" "$@"
fi

case $kind in
  bf16 | fp8 | nvfp4 | mxfp4 | f32) kv=$kind; recipe=full ;;
  nvfp4-vanilla | mxfp4-vanilla) kv=${kind%-vanilla}; recipe=vanilla ;;
  *) echo "run_experiment: unknown kind '$kind' (bf16, fp8, nvfp4, nvfp4-vanilla, mxfp4, mxfp4-vanilla, f32, all)" >&2
     exit 2 ;;
esac

model=${MODEL:-../shared/models/tq6}
[ -f "$model/config.json" ] || { echo "run_experiment: no checkpoint at $model (set MODEL)" >&2; exit 1; }
model=$(cd "$model" && pwd)
mkdir -p "$out"
out=$(cd "$out" && pwd)
port=${PORT:-$($py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}

calib=${CALIB:-auto}
if [ "$calib" = auto ]; then
  calib=none
  texts=("$model"/texts/calib_*.txt)
  if [ "$kv" != bf16 ] && [ "$kv" != f32 ] && [ "$recipe" = full ] && [ -f "$out/calib.safetensors" ]; then
    calib=$out/calib.safetensors      # a resumed run keeps its first calibration
  elif [ "$kv" != bf16 ] && [ "$kv" != f32 ] && [ "$recipe" = full ] && [ -f "${texts[0]}" ]; then
    echo "run_experiment: calibrating $model into $out/calib.safetensors" >&2
    "$bin" calibrate --model "$model" --backend "${BACKEND:-auto}" --texts "${texts[@]}" \
      --out "$out/calib.safetensors" --quiet > "$out/calib.log"
    calib=$out/calib.safetensors
  fi
fi
calib_json=null
[ "$calib" != none ] && calib_json="\"$(cd "$(dirname "$calib")" && pwd)/$(basename "$calib")\""

# KV pages: the CPU backend sizes its cache itself (0); a GPU cache is given
# pages for MAX_SEQS sequences of up to 16 pages (2048 tokens) each.
backend=${BACKEND:-auto}
if [ "$backend" = cpu ]; then kv_blocks=${KV_BLOCKS:-0}; else kv_blocks=${KV_BLOCKS:-$(( ${MAX_SEQS:-64} * 16 ))}; fi
cat > "$out/serve.json" <<EOF
{"model": "$model", "backend": "$backend", "kv_dtype": "$kv", "recipe": "$recipe", "calib": $calib_json,
 "max_seqs": ${MAX_SEQS:-64}, "kv_blocks": $kv_blocks, "metrics_port": ${METRICS_PORT:-0}, "kl_sample_rate": 0,
 "coordinator": {"bind": "127.0.0.1", "port": $port}}
EOF

"$bin" serve --config "$out/serve.json" 2> "$out/serve.log" &
server=$!
trap 'kill -TERM $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 1200); do
  grep -q "listening on" "$out/serve.log" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { echo "run_experiment: the server exited:" >&2; tail -20 "$out/serve.log" >&2; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$out/serve.log" || { echo "run_experiment: the server did not start" >&2; exit 1; }
echo "run_experiment: $kind ($kv, recipe $recipe) serving on port $port; training into $out" >&2

limit=()
if [ -n "${DEADLINE:-}" ]; then
  left=$(( DEADLINE - $(date +%s) - 30 ))
  [ $left -gt 0 ] || { echo "run_experiment: no time left before DEADLINE" >&2; exit 0; }
  limit=(--time-limit-s "$left")
fi
BUILD="$build" $py "$here/train.py" --server "tcp://127.0.0.1:$port" --model "$model" --out "$out" "$@" "${limit[@]}" \
  2>&1 | tee -a "$out/train.log"
