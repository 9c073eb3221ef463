#!/usr/bin/env bash
# `make demo`: starts `fp4rollout serve` on the bundled demo model (NVFP4 KV
# cache, every sample monitored against a BF16-KV shadow, the metrics port
# and its dashboard on; the GPU when there is one), runs the trainer's side
# (demo_client.py: text prompts, n = 4, completions as text with per-token
# log-probs and KL), prints the dashboard's URL and a summary line, and
# stops the server with SIGINT. Usage: examples/demo/run.sh [BUILD_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-${BUILD:-build}}
bin=$build/fp4rollout
py=/usr/bin/python3
[ -x "$bin" ] && [ -f "$build/libfp4rollout_client.so" ] ||
  { echo "demo: build first (make $bin $build/libfp4rollout_client.so)" >&2; exit 1; }
dir=$(mktemp -d)
server=
cleanup() {
  if [ -n "$server" ] && kill -0 "$server" 2>/dev/null; then kill -INT "$server"; wait "$server" || true; fi
  rm -rf "$dir"
}
trap cleanup EXIT

# Two free loopback ports, one for the trainers, one for metrics.
read -r port mport < <($py -c 'import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')

# 256 KV pages: 16 of 128 tokens for each of the 16 sequences (the CUDA
# backend needs the count; the CPU's automatic one is the same).
"$bin" serve --model models/demo --kv nvfp4 --port "$port" --metrics-port "$mport" --kl-sample-rate 1 \
  --max-seqs 16 --kv-blocks 256 --log-stats-interval 1 2> "$dir/serve.log" &
server=$!
for _ in $(seq 300); do   # up to 30 s for the model to load and the socket to bind
  grep -q "listening on" "$dir/serve.log" && break
  kill -0 "$server" 2>/dev/null || { cat "$dir/serve.log" >&2; echo "demo: the server did not start" >&2; exit 1; }
  sleep 0.1
done
grep -q "listening on" "$dir/serve.log" || { cat "$dir/serve.log" >&2; echo "demo: the server did not start" >&2; exit 1; }

PYTHONPATH=trainer_bridge/client/python FP4ROLLOUT_CLIENT_LIB=$build/libfp4rollout_client.so \
  $py -u examples/demo/demo_client.py --endpoint "tcp://127.0.0.1:$port" \
  --dashboard "http://127.0.0.1:$mport/dashboard"

kill -INT "$server"
rc=0
wait "$server" || rc=$?
server=
{ grep " serve: served " "$dir/serve.log" || true; tail -n 1 "$dir/serve.log"; } | sed "s/^/server| /"
[ "$rc" -eq 0 ] && grep -q "serve: stopped" "$dir/serve.log" || { echo "demo: the server did not stop cleanly" >&2; exit 1; }
echo "demo: server stopped cleanly"
