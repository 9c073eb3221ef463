# Sourced by the serve_* integration scripts (not a test itself:
# scripts/run-tests.sh runs only *.sh). Expects `name` set to the script's
# name. Defines build, bin (fp4rollout), cli (fp4rollout-client), py, dir (a
# temporary folder removed at exit), server_pid and pids (processes killed at
# exit), fail MESSAGE (prints the last lines of every $dir/*.log and exits 1),
# free_port, and start_server NAME CONFIG-JSON [LAUNCHER...] (PORT in the
# JSON becomes a free port; the server's log is $dir/NAME.log; its endpoint
# lands in $ep; a launcher such as mpirun -np 2 runs the server under it),
# need_gpu_tq6 (for tests/gpu: tq6's folder into $tq6, or the script ends
# skipped without a GPU or tq6), device_mib PID (its device memory in MiB);
# checks that the binaries are built.
build=${BUILD:-build}
bin=$build/fp4rollout
cli=$build/fp4rollout-client
py=${FR_PYTHON:-/usr/bin/python3}   # FR_PYTHON: another interpreter with numpy (a GPU machine's)
dir=$(mktemp -d)
server_pid=
pids=()
cleanup() {
  # TERM first: mpirun passes it on to its ranks (KILL would orphan them)
  local all=("${pids[@]}") p
  [ -n "$server_pid" ] && all+=("$server_pid")
  for p in "${all[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 30); do
    local alive=0
    for p in "${all[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive -eq 0 ] && break
    sleep 0.1
  done
  for p in "${all[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT
fail() {
  echo "$name: $*" >&2
  for f in "$dir"/*.log; do [ -f "$f" ] && { echo "--- $(basename "$f"):" >&2; tail -20 "$f" >&2; }; done
  exit 1
}
[ -x "$bin" ] && [ -x "$cli" ] || fail "$bin or $cli is missing (run make)"
export OPENBLAS_NUM_THREADS=1
need_gpu_tq6() {
  tq6=$(cd "${FR_TQ6_DIR:-../shared/models/tq6}" 2>/dev/null && pwd || true)
  if ! nvidia-smi -L >/dev/null 2>&1; then echo "$name: SKIP: no GPU"; exit 0; fi
  if [ -z "$tq6" ] || [ ! -f "$tq6/config.json" ]; then echo "$name: SKIP: tq6 not found"; exit 0; fi
}
device_mib() { # PID -> its device memory in MiB, as nvidia-smi counts it (tests/gpu)
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits | awk -F', *' -v p="$1" '$1 == p {print $2}'
}
free_port() { $py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'; }
start_server() { # NAME CONFIG-JSON [LAUNCHER...] -> endpoint in $ep
  local port; port=$(free_port)
  echo "$2" | sed "s/PORT/$port/" > "$dir/$1.json"
  "${@:3}" "$bin" serve --config "$dir/$1.json" 2> "$dir/$1.log" &
  pids+=($!)
  for _ in $(seq 600); do
    grep -q "listening on" "$dir/$1.log" 2>/dev/null && { ep=tcp://127.0.0.1:$port; return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || fail "server $1 exited at start"
    sleep 0.05
  done
  fail "server $1 did not start"
}
