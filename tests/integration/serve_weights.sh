#!/usr/bin/env bash
# Weight updates, divergence fields and CURVE authentication of
# `fp4rollout serve` over loopback, through the Python ctypes client
# (serve_weights.py) and fp4rollout-client push-weights: a mid-stream update
# to synthetic:tiny:7 (tokens after it carry version 2, greedy outputs then
# equal a fresh synthetic:tiny:7 server's); a bad checksum, a NaN, a missing
# tensor and a wrong shape refused with the old weights still serving;
# partial updates (Python partial=True, push-weights --partial) that carry
# the tensors not sent over; a
# client without keys or with an unlisted key gets no reply, and no
# metrics snapshot from the CURVE server's PUB socket either.
set -euo pipefail
name=serve_weights
source "$(dirname "$0")/serve_setup.bash"
[ -x "$bin" ] && [ -x "$cli" ] && [ -f "$build/libfp4rollout_client.so" ] || fail "build first (make)"
$py -c 'import numpy' 2>/dev/null || fail "python3-numpy is missing (scripts/install-deps.sh)"


$cli keygen > "$dir/server.key" && $cli keygen > "$dir/client.key" && $cli keygen > "$dir/other.key" || fail "keygen"
$py - "$dir" <<'PY'
import json, sys, zmq
d = sys.argv[1]
s, c, o = (json.load(open(f"{d}/{n}.key")) for n in ("server", "client", "other"))
json.dump({"server_secret": s["secret"], "server_public": zmq.curve_public(s["secret"].encode()).decode(),
           "client_public": c["public"], "client_secret": c["secret"],
           "other_public": o["public"], "other_secret": o["secret"]}, open(f"{d}/keys.json", "w"))
PY
ss=$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["server_secret"])' "$dir/keys.json")
cp=$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["client_public"])' "$dir/keys.json")

base='"backend": "cpu", "kv_dtype": "f32", "max_seqs": 32, "coordinator": {"bind": "127.0.0.1", "port": PORT}'
start_server main "{\"model\": \"synthetic:tiny\", $base, \"kl_sample_rate\": 0.25}"; main_ep=$ep
start_server fresh7 "{\"model\": \"synthetic:tiny:7\", $base}"; fresh_ep=$ep
pub_port=$(free_port)
start_server curve "{\"model\": \"synthetic:tiny\", $base, \"metrics_pub_port\": $pub_port, \"curve\": {\"server_secret_key\": \"$ss\", \"client_public_keys\": [\"$cp\"]}}"
curve_ep=$ep

$cli push-weights --model synthetic:tiny:7 --export "$dir/w7.bin" > "$dir/w7.jsonl" || fail "export"
BUILD="$build" timeout 300 $py "$(dirname "$0")/serve_weights.py" "$main_ep" "$fresh_ep" "$curve_ep" \
  "$dir/keys.json" "$dir/w7.bin" "$dir/w7.jsonl" "tcp://127.0.0.1:$pub_port" || fail "the Python checks failed"
grep -q "refused a client" "$dir/curve.log" || fail "the CURVE server logged no refusal"

# Weights over NCCL: the CPU backend refuses nccl_group_init (and a begin
# with transport nccl) with nccl_unavailable and keeps serving; the Python
# client refuses a group on a missing device, or the server refuses it.
BUILD="$build" PYTHONPATH=trainer_bridge/client/python timeout 60 $py - "$main_ep" <<'PY' || fail "weights over NCCL on the CPU backend"
import os, sys, zmq
from fp4rollout_client import ClientError, RolloutClient, ServerError

def s(x):  # a msgpack str
    b = x.encode()
    return bytes([0xa0 | len(b)]) + b

def frame(kind, *kv):
    return bytes([0x80 | (2 + len(kv) // 2)]) + s("type") + s(kind) + s("v") + b"\x01" + b"".join(kv)

sock = zmq.Context.instance().socket(zmq.DEALER)
sock.setsockopt(zmq.RCVTIMEO, 20000)
sock.connect(sys.argv[1])
sock.send(frame("nccl_group_init", s("unique_id"), b"\xc4\x80" + bytes(range(128))))
r = sock.recv()
assert b"nccl_unavailable" in r and b"cpu backend" in r, r
begin = frame("update_weights_begin", s("version"), b"\x09", s("total_bytes"), b"\x08", s("bucket_bytes"), b"\x08",
              s("transport"), s("nccl"), s("tensors"),
              b"\x91\x83" + s("name") + s("model.norm.weight") + s("dtype") + s("f32") + s("shape") + b"\x91\x02")
sock.send(begin)
r = sock.recv()
assert b"nccl_unavailable" in r and b"nccl_group_init" in r, r
sock.send(frame("nccl_group_close"))
r = sock.recv()
assert b"nccl_group_reply" in r and b"closed" in r, r
c = RolloutClient(sys.argv[1])
try:
    c.init_weight_group(device=0)
    raise SystemExit("init_weight_group succeeded against a CPU server")
except ServerError as e:
    assert e.code == "nccl_unavailable", e
except ClientError as e:  # no CUDA device here, or a library without CUDA: nothing was sent
    assert "CUDA" in str(e), e
st = c.stats()["server"]
assert st["weight_version"] == 5 and not st["updating"], st   # serve_weights.py left version 5
print("weights over NCCL refused on the CPU backend")
PY

# The C tool: an update to the same weights as version 8 in bf16, then a
# refused one (its error names the tensor), and the server still answers;
# the same tensors as a partial update (--partial) are accepted.
c() { timeout 60 "$cli" --endpoint "$main_ep" --timeout-ms 20000 "$@"; }
c push-weights --model synthetic:tiny:7 --version 8 --dtype bf16 --bucket-mib 1 > "$dir/push.json" || fail "push-weights"
$py -c 'import json,sys; d=json.load(open(sys.argv[1])); sys.exit(0 if d["committed"] and d["weight_version"] == 8 else 1)' "$dir/push.json" ||
  fail "push-weights reply: $(cat "$dir/push.json")"
if c push-weights --model synthetic:tiny:7 --version 9 --skip lm_head.weight > "$dir/bad.json" 2> "$dir/bad.err"; then
  fail "an update without lm_head.weight was accepted"
fi
grep -q "missing_tensor" "$dir/bad.err" && grep -q "lm_head.weight" "$dir/bad.err" || fail "missing tensor: $(cat "$dir/bad.err")"
c stats | $py -c 'import json,sys; d=json.load(sys.stdin)["server"]; sys.exit(0 if d["weight_version"] == 8 and d["updates_failed"] >= 5 else 1)' ||
  fail "stats after the refused update"
c push-weights --model synthetic:tiny:7 --version 9 --skip lm_head.weight --partial > "$dir/partial.json" ||
  fail "a partial push-weights was refused"
c stats | $py -c 'import json,sys; d=json.load(sys.stdin)["server"]; sys.exit(0 if d["weight_version"] == 9 else 1)' ||
  fail "stats after the partial update"
echo "serve_weights: all checks passed"
