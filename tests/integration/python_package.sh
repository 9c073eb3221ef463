#!/usr/bin/env bash
# The Python client as a package (trainer_bridge/client/python): installed
# with pip into a fresh virtual environment (against Debian's setuptools, no
# index), it finds the C library without any environment variable, from any
# folder; then python_package.py checks it against a server started from
# flags alone: text prompts, prompts of every integer kind, one request id
# everywhere, the asyncio API, the dead-endpoint error.
set -euo pipefail
name=python_package
source "$(dirname "$0")/serve_setup.bash"
[ -f "$build/libfp4rollout_client.so" ] || fail "$build/libfp4rollout_client.so is missing (run make)"

$py -m venv --system-site-packages "$dir/venv" || fail "python3 -m venv failed (python3-venv)"
BUILD=$build "$dir/venv/bin/pip" install --no-build-isolation --no-index -q trainer_bridge/client/python \
  > "$dir/pip.log" 2>&1 || fail "pip install failed: $(tail -5 "$dir/pip.log")"
rm -rf trainer_bridge/client/python/build trainer_bridge/client/python/*.egg-info   # pip's in-tree build

port=$(free_port)
"$bin" serve --model=synthetic:tiny --kv=nvfp4 --port "$port" --max-num-seqs 4 --kl-sample-rate=1 \
  --log-stats-interval=0.5 2> "$dir/serve.log" &
pids+=($!)
for _ in $(seq 600); do grep -q "listening on" "$dir/serve.log" && break; sleep 0.05; done
grep -q "listening on" "$dir/serve.log" || fail "the server did not start"

dead=$(free_port)
script=$PWD/tests/integration/python_package.py
# From an empty folder, with nothing that points at the tree.
(cd "$dir" && env -u FP4ROLLOUT_CLIENT_LIB -u BUILD -u PYTHONPATH \
   "$dir/venv/bin/python" "$script" "tcp://127.0.0.1:$port" "tcp://127.0.0.1:$dead") ||
  fail "python_package.py failed"
# the periodic serving summary, timestamped and leveled
grep -Eq '^[0-9-]{10}T[0-9:.]{12}Z INFO  serve: [0-9.]+ tokens/s, [0-9]+ running, [0-9]+ waiting, KV [0-9.]+% used \([0-9]+ of 64 pages\), weight version 0$' \
  "$dir/serve.log" || fail "no serving summary line in the server's log"
echo "$name: all checks passed"
