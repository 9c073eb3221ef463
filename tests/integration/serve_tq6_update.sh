#!/usr/bin/env bash
# The trainer bridge on tq6 under mpirun (serve_tq6_update.py says what is
# checked): two ranks of one tp-2 engine, the Python ctypes client, a
# mid-stream update to a perturbed tq6, and a fresh server from the
# perturbed checkpoint on disk for the greedy comparison. Skipped with a
# message when mpirun, python3-numpy or tq6 is missing. FR_SERVE_UPDATE_MODEL
# runs the same checks on another checkpoint (the MoE tqm, say).
set -euo pipefail
name=serve_tq6_update
source "$(dirname "$0")/serve_setup.bash"
tq6=${FR_SERVE_UPDATE_MODEL:-${FR_TQ6_DIR:-../shared/models/tq6}}
command -v mpirun >/dev/null 2>&1 || { echo "$name: SKIP: mpirun not found"; exit 0; }
[ -f "$tq6/config.json" ] || { echo "$name: SKIP: tq6 not found (set FR_TQ6_DIR)"; exit 0; }
tq6=$(cd "$tq6" && pwd)   # the config resolves relative paths against its own folder
$py -c 'import numpy' 2>/dev/null || { echo "$name: SKIP: python3-numpy missing"; exit 0; }
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
here=$(dirname "$0")
$py "$here/serve_tq6_update.py" "$tq6" "$dir/perturbed" > "$dir/perturb.log" 2>&1 || fail "perturbing tq6 failed"

mpi=(mpirun --oversubscribe -x OPENBLAS_NUM_THREADS -np 2)
[ "$(id -u)" -eq 0 ] && mpi+=(--allow-run-as-root)
start() { # NAME MODEL TP LAUNCH... -> the endpoint in $ep
  local n=$1 model=$2 tp=$3; shift 3
  local port; port=$(free_port)
  cat > "$dir/$n.json" <<JSON
{"model": "$model", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16, "tp": $tp,
 "coordinator": {"bind": "127.0.0.1", "port": $port}}
JSON
  "$@" "$bin" serve --config "$dir/$n.json" > /dev/null 2> "$dir/$n.log" &
  pids+=($!)
  for _ in $(seq 600); do
    grep -q "listening on" "$dir/$n.log" 2>/dev/null && { ep="tcp://127.0.0.1:$port"; return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || fail "server $n exited at start"
    sleep 0.05
  done
  fail "server $n did not start"
}
start mpi "$tq6" 2 "${mpi[@]}"
mpi_ep=$ep
start fresh "$dir/perturbed" 1
fresh_ep=$ep
timeout 240 $py "$here/serve_tq6_update.py" --check "$mpi_ep" "$fresh_ep" "$dir/perturbed" || fail "checks failed"
echo "$name: all checks passed"
