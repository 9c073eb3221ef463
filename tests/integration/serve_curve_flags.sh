#!/usr/bin/env bash
# CURVE without a JSON file of keys (configs/README.md, "CURVE without a
# file of keys"): serve --bind beyond loopback without CURVE is refused
# with the commands that make keys; --curve-secret-key-file (keygen's JSON
# or the bare key), --trainer-keys and --client-keys, or the
# FP4ROLLOUT_CURVE_* variables, turn CURVE on with roles: the trainer may
# pause, a rollout client may generate but not pause, a client without
# keys is never answered; a key file without a key or missing is refused
# naming the file, never printing the key.
set -euo pipefail
name=serve_curve_flags
source "$(dirname "$0")/serve_setup.bash"
[ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"

# Beyond loopback without CURVE: refused at once (exit 2), saying how to make keys.
set +e
"$bin" serve --model synthetic:tiny --backend cpu --bind 0.0.0.0 --port "$(free_port)" --metrics-port 0 \
  > /dev/null 2> "$dir/open.err"
rc=$?
set -e
[ $rc -eq 2 ] || fail "serve --bind 0.0.0.0 without CURVE exited $rc, expected 2"
for want in "fp4rollout-client keygen" "--curve-secret-key-file" "--trainer-keys" "FP4ROLLOUT_CURVE_SECRET_KEY"; do
  grep -qF -- "$want" "$dir/open.err" || fail "the refusal does not mention $want: $(cat "$dir/open.err")"
done

for k in server trainer client other extra; do $cli keygen > "$dir/$k.json" || fail "keygen"; done
key() { $py -c 'import json,sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "$dir/$1.json" "$2"; }
server_pub=$(key server public); tpub=$(key trainer public); cpub=$(key client public)

start_curve() { # NAME ARGS... (with PORT replaced) -> endpoint in $ep
  local nm=$1 port; shift; port=$(free_port)
  "$bin" serve --model synthetic:tiny --backend cpu --metrics-port 0 --port "$port" "$@" 2> "$dir/$nm.log" &
  pids+=($!)
  for _ in $(seq 600); do
    grep -q "listening on" "$dir/$nm.log" 2>/dev/null && { ep=tcp://127.0.0.1:$port; return 0; }
    kill -0 "${pids[-1]}" 2>/dev/null || fail "server $nm exited at start"
    sleep 0.05
  done
  fail "server $nm did not start"
}
roles() { # ENDPOINT: the trainer pauses and resumes, the rollout client generates and may not pause, no keys: no answer
  BUILD="$build" timeout 120 $py - "$1" "$dir" "$server_pub" <<'PY' || fail "roles on $1"
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "trainer_bridge", "client", "python"))
from fp4rollout_client import ClientError, RolloutClient, ServerError
ep, d, spub = sys.argv[1:4]
k = {n: json.load(open(f"{d}/{n}.json")) for n in ("trainer", "client", "other")}
def client(n, t=30000):
    return RolloutClient(ep, timeout_ms=t, server_public_key=spub, public_key=k[n]["public"], secret_key=k[n]["secret"])
with client("trainer") as t:
    assert t.pause("keep")["mode"] == "keep" and t.resume(recompute=True)["released"] == 0
with client("client") as c:
    (s,) = list(c.generate([256, 1, 2], max_tokens=4, temperature=0.0, stop_token_ids=[]))
    assert len(s.token_ids) == 4
    try:
        c.pause("wait")
        raise SystemExit("a rollout client paused the server")
    except ServerError as e:
        assert e.code == "forbidden", e
for who in (lambda: RolloutClient(ep, timeout_ms=1500), lambda: client("other", 1500)):
    with who() as x:
        try:
            x.hello()
            raise SystemExit("a client without an allowed key was answered")
        except ClientError:
            pass
PY
}

# Flags: keygen's JSON as the key file.
start_curve flags --bind 127.0.0.1 --curve-secret-key-file "$dir/server.json" --trainer-keys "$tpub" --client-keys "$cpub"
grep -qF "server public key $server_pub" "$dir/flags.log" || fail "the server's public key is not keygen's"
grep -q "1 with the trainer role" "$dir/flags.log" || fail "the trainer key has no trainer role: $(grep CURVE "$dir/flags.log")"
roles "$ep"

# The environment, with the bare secret key in a file, and beyond loopback.
key server secret > "$dir/server.key"
FP4ROLLOUT_CURVE_SECRET_KEY_FILE="$dir/server.key" FP4ROLLOUT_CURVE_TRAINER_KEYS="$tpub" \
  FP4ROLLOUT_CURVE_CLIENT_KEYS=" $cpub , $(key extra public)" start_curve env --bind 0.0.0.0
grep -q "3 allowed client keys, 1 with the trainer role" "$dir/env.log" || fail "the environment's keys: $(grep CURVE "$dir/env.log")"
grep -qF "server public key $server_pub" "$dir/env.log" || fail "the environment's key file gave another key"
grep -q "listening on tcp://0.0.0.0:" "$dir/env.log" || fail "with CURVE on, --bind 0.0.0.0 was not taken"
roles "$ep"
# the secret key itself in the environment; a flag's key file overrides it
FP4ROLLOUT_CURVE_SECRET_KEY="$(key other secret)" start_curve env2 --curve-secret-key-file "$dir/server.json" \
  --trainer-keys "$tpub" --client-keys "$cpub"
grep -qF "server public key $server_pub" "$dir/env2.log" || fail "the flag's key file did not override the environment's key"
roles "$ep"

# Refusals: a file without a key (exit 2), a missing file (exit 1); neither prints a key.
echo "not a key" > "$dir/bad.key"
set +e
"$bin" serve --model synthetic:tiny --curve-secret-key-file "$dir/bad.key" --trainer-keys "$tpub" 2> "$dir/bad.err"
rc_bad=$?
"$bin" serve --model synthetic:tiny --curve-secret-key-file "$dir/none.key" --trainer-keys "$tpub" 2> "$dir/none.err"
rc_none=$?
FP4ROLLOUT_CURVE_SECRET_KEY=short "$bin" serve --model synthetic:tiny --trainer-keys "$tpub" 2> "$dir/envbad.err"
rc_env=$?
set -e
[ $rc_bad -eq 2 ] && grep -q "bad.key: holds no CURVE secret key" "$dir/bad.err" || fail "bad key file: $rc_bad $(cat "$dir/bad.err")"
[ $rc_none -eq 1 ] && grep -q "cannot read the CURVE key file" "$dir/none.err" || fail "missing key file: $rc_none $(cat "$dir/none.err")"
[ $rc_env -eq 2 ] && grep -q "FP4ROLLOUT_CURVE_SECRET_KEY is not a CURVE secret key" "$dir/envbad.err" ||
  fail "a bad key in the environment: $rc_env $(cat "$dir/envbad.err")"
! grep -qF -- "$(key server secret)" "$dir"/*.err "$dir"/*.log || fail "a secret key was printed"
echo "serve_curve_flags: ok"
