#!/usr/bin/env bash
# The Figure 8 experiment in time-limited calls: `run_experiment.sh fig8 OUT
# [train.py options...]` runs this. Each call, within CALL_S seconds:
#   1. the warm-up: sft.py into OUT/sft (resumed, SFT_ARGS), until its
#      held-out evaluation is written;
#   2. then the runs of bf16, nvfp4 (full recipe, calibrated on the
#      warm-up's texts) and nvfp4-vanilla, resumed (train.py --task arith
#      --resume): with PARALLEL=1 (the default on a GPU, where one tq6
#      server and trainer leave the device mostly idle) all three at once,
#      each with its own server, until the call's deadline; with PARALLEL=0
#      (the default on the CPU), while MIN_LEFT seconds remain, the one with
#      the fewest steps, so the three advance together;
#   3. OUT/compare.png and OUT/compare.md over the steps all three have.
# It prints "fig8: done" once every run has --steps (default 300) steps.
# Moving a run to another machine takes OUT/sft/sft_eval.json, and per run
# OUT/KIND/metrics.csv, calib.safetensors (nvfp4) and either state.pt with
# OUT/sft, or only OUT/KIND/handoff (its BF16 policy: examples/dapo/run_state.py).
# Environment: run_experiment.sh's, and CALL_S (540), SFT_ARGS, OPERANDS (8),
# DIGITS (20), DEVICE, MIN_LEFT (150), PARALLEL.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-/usr/bin/python3}
out=$1
shift
t0=$(date +%s)
deadline=$(( t0 + ${CALL_S:-540} ))
min_left=${MIN_LEFT:-150}
operands=${OPERANDS:-8}
digits=${DIGITS:-20}
if [ -z "${DEVICE:-}" ]; then
  if nvidia-smi -L > /dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
if [ -z "${PARALLEL:-}" ]; then
  if [ "$DEVICE" = cpu ]; then PARALLEL=0; else PARALLEL=1; fi
fi
# the step count asked for: the last --steps of the options, else 300
steps=300
prev=
for a in "$@"; do
  [ "$prev" = --steps ] && steps=$a
  prev=$a
done
mkdir -p "$out"

# 1. The warm-up.
if [ ! -f "$out/sft/sft_eval.json" ]; then
  left=$(( deadline - $(date +%s) - 30 ))
  echo "fig8: warm-up into $out/sft ($left s left in this call)" >&2
  rc=0
  # shellcheck disable=SC2086  # SFT_ARGS is a list of options
  $py "$here/sft.py" --model "${MODEL:-../shared/models/tq6}" --out "$out/sft" --operands "$operands" \
    --digits "$digits" --device "$DEVICE" --resume --time-limit-s "$left" ${SFT_ARGS:-} \
    2>&1 | tee -a "$out/sft.log" || rc=$?
  [ -f "$out/sft/sft_eval.json" ] || { echo "fig8: the warm-up goes on in the next call (rc $rc)"; exit 0; }
fi

done_steps() { # KIND -> steps in OUT/KIND/metrics.csv
  local f=$out/$1/metrics.csv
  if [ -f "$f" ]; then echo $(( $(wc -l < "$f") - 1 )); else echo 0; fi
}

run_kind() { # KIND [train.py options]: one resumed run of KIND until the call's deadline
  local kind=$1 model=$out/sft
  shift
  # a run carried here as its handoff alone (no state.pt, no warm-up folder):
  # its server and trainer start from the handoff's BF16 policy
  if [ ! -f "$out/$kind/state.pt" ] && [ -f "$out/$kind/handoff/config.json" ]; then model=$out/$kind/handoff; fi
  MODEL="$model" DEADLINE=$deadline bash "$here/run_experiment.sh" "$kind" "$out/$kind" --task arith \
    --operands "$operands" --digits "$digits" --device "$DEVICE" --steps "$steps" --resume "$@"
}

# 2. The runs: all three at once, or the least advanced first.
if [ "$PARALLEL" = 1 ] && [ $(( deadline - $(date +%s) )) -ge "$min_left" ]; then
  pids=()
  for k in bf16 nvfp4 nvfp4-vanilla; do
    [ "$(done_steps "$k")" -ge "$steps" ] && continue
    echo "fig8: $k from step $(done_steps "$k"), beside the others ($(( deadline - $(date +%s) )) s left)" >&2
    mkdir -p "$out/$k"
    run_kind "$k" "$@" > "$out/$k/call.log" 2>&1 &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || echo "fig8: a run ended with status $? (its call.log)" >&2; done
fi
while [ "$PARALLEL" != 1 ] && [ $(( deadline - $(date +%s) )) -ge "$min_left" ]; do
  pick=
  best=
  for k in bf16 nvfp4 nvfp4-vanilla; do
    n=$(done_steps "$k")
    [ "$n" -ge "$steps" ] && continue
    if [ -z "$best" ] || [ "$n" -lt "$best" ]; then pick=$k; best=$n; fi
  done
  [ -n "$pick" ] || break
  echo "fig8: $pick from step $best ($(( deadline - $(date +%s) )) s left in this call)" >&2
  before=$best
  run_kind "$pick" "$@"
  # a call that made no step (the time went to starting up) ends here
  [ "$(done_steps "$pick")" -gt "$before" ] || break
done

# 3. The figure and the tables over the steps all three have.
have=()
for k in bf16 nvfp4 nvfp4-vanilla; do [ "$(done_steps "$k")" -gt 0 ] && have+=("$k"); done
if [ ${#have[@]} -eq 3 ]; then
  $py "$here/plot.py" --compare "$out/bf16" "$out/nvfp4" "$out/nvfp4-vanilla" \
    --labels "BF16 KV,NVFP4 KV (full recipe),NVFP4 KV (vanilla)" --smooth 10 --paired --out "$out/compare.png" \
    > "$out/compare.md"
  cat "$out/compare.md"
fi
echo "fig8: steps: bf16 $(done_steps bf16), nvfp4 $(done_steps nvfp4), nvfp4-vanilla $(done_steps nvfp4-vanilla) of $steps"
all=1
for k in bf16 nvfp4 nvfp4-vanilla; do [ "$(done_steps "$k")" -ge "$steps" ] || all=0; done
[ $all -eq 1 ] && echo "fig8: done"
exit 0
