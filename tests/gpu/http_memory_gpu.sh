#!/usr/bin/env bash
# The HTTP API's memory release on the CUDA backend (docs/http.md), with
# tq6 and an NVFP4 cache on one GPU:
#  - greedy /generate gives the same tokens before the release and after
#    the resume;
#  - /release_memory_occupation (KV cache and weights) gives device memory
#    back: the server's use as nvidia-smi reports it drops by at least the
#    size of the weights, and /generate is refused with 503 meanwhile;
#  - /resume_memory_occupation brings it back, and /continue_generation
#    serves again.
# Prints the server's device memory at each stage. Needs a GPU, nvidia-smi,
# curl and tq6 ($FR_TQ6_DIR or ../shared/models/tq6); skipped otherwise.
# usage: tests/gpu/http_memory_gpu.sh [BUILD_DIR]
set -euo pipefail
name=http_memory_gpu
BUILD=${1:-${BUILD:-build}}
source "$(dirname "$0")/../integration/serve_setup.bash"
need_gpu_tq6
command -v curl >/dev/null || { echo "$name: SKIP: no curl"; exit 0; }
hport=$(free_port)
start_server h "{\"model\": \"$tq6\", \"backend\": \"cuda\", \"kv_dtype\": \"nvfp4\", \"max_seqs\": 16,
 \"kv_blocks\": 4096, \"metrics_port\": $hport, \"coordinator\": {\"bind\": \"127.0.0.1\", \"port\": PORT}}"
http=http://127.0.0.1:$hport
post() { local d='{}'; [ $# -ge 2 ] && d=$2; curl -s -o "$dir/r.json" -w '%{http_code}' "$http$1" -d "$d"; }
body='{"input_ids": [256, 100, 101, 102, 103, 104], "sampling_params": {"max_new_tokens": 32, "temperature": 0, "ignore_eos": true}}'
[ "$(post /generate "$body")" = 200 ] || fail "generate: $(cat "$dir/r.json")"
before=$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["output_ids"])' "$dir/r.json")
m0=$(device_mib "${pids[0]}")
[ "$(post /pause_generation '{"mode": "abort"}')" = 200 ] || fail "pause: $(cat "$dir/r.json")"
[ "$(post /release_memory_occupation '{"tags": ["kv_cache", "weights"]}')" = 200 ] || fail "release: $(cat "$dir/r.json")"
sleep 1
m1=$(device_mib "${pids[0]}")
[ "$(post /generate "$body")" = 503 ] || fail "generate while released was not refused with 503: $(cat "$dir/r.json")"
[ "$(post /resume_memory_occupation)" = 200 ] || fail "resume: $(cat "$dir/r.json")"
[ "$(post /continue_generation)" = 200 ] || fail "continue: $(cat "$dir/r.json")"
m2=$(device_mib "${pids[0]}")
[ "$(post /generate "$body")" = 200 ] || fail "generate after resume: $(cat "$dir/r.json")"
after=$($py -c 'import json,sys; print(json.load(open(sys.argv[1]))["output_ids"])' "$dir/r.json")
weights_mib=$(du -cm "$tq6"/model-*.safetensors | tail -1 | cut -f1)
echo "$name: server device memory: serving $m0 MiB, released $m1 MiB, resumed $m2 MiB (weights on disk: $weights_mib MiB)"
[ "$before" = "$after" ] || fail "greedy tokens differ after the resume: $before vs $after"
[ $((m0 - m1)) -ge "$weights_mib" ] || fail "the release gave back $((m0 - m1)) MiB, less than the weights' $weights_mib MiB"
[ "$m2" -ge $((m1 + weights_mib)) ] || fail "the resume did not allocate again ($m1 -> $m2 MiB)"
echo "$name: ok"
