#!/usr/bin/env bash
# The metrics endpoint of `fp4rollout serve` (docs/metrics.md) on loopback:
# a CPU server on synthetic:tiny with an NVFP4 cache and every sample
# monitored serves 6 prompts x 2 samples; then /metrics (Prometheus text)
# and /metrics.json agree, and a headless Chromium loads /dashboard, runs
# its script, and the figures the page shows (health, and the divergence of
# the weight version serving) equal /metrics; a screenshot is taken. The
# browser part is skipped, with a message, when chromium is absent. The
# same snapshots arrive on the metrics PUB socket: a Python
# MetricsSubscriber that joined before the requests saw the counters grow,
# and its last snapshot, and the one `fp4rollout-client watch-metrics`
# prints, equal /metrics.json.
set -euo pipefail
name=serve_dashboard
source "$(dirname "$0")/serve_setup.bash"
port=$(free_port)
mport=$(free_port)
pport=$(free_port)
cat > "$dir/serve.json" <<JSON
{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "nvfp4", "max_seqs": 8, "kl_sample_rate": 1.0,
 "metrics_port": $mport, "metrics_pub_port": $pport, "coordinator": {"bind": "127.0.0.1", "port": $port}}
JSON
"$bin" serve --config "$dir/serve.json" 2> "$dir/serve.log" &
server_pid=$!
for _ in $(seq 200); do
  grep -q "listening on" "$dir/serve.log" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || fail "the server exited at start"
  sleep 0.05
done
grep -q "metrics on http://127.0.0.1:$mport/metrics" "$dir/serve.log" || fail "no metrics endpoint announced"
grep -q "metrics snapshots on tcp://127.0.0.1:$pport" "$dir/serve.log" || fail "no metrics PUB socket announced"
# a trainer-side subscriber, joined before the requests, logs every snapshot
PYTHONPATH=trainer_bridge/client/python $py - "tcp://127.0.0.1:$pport" "$dir/sub.jsonl" "$dir/sub.ready" <<'PY' > "$dir/sub.log" 2>&1 &
import json, sys, time
from fp4rollout_client import MetricsSubscriber
with MetricsSubscriber(sys.argv[1]) as sub, open(sys.argv[2], "w") as out:
    first = sub.next(10000)
    assert first is not None, "no snapshot within 10 s"
    open(sys.argv[3], "w").close()
    out.write(json.dumps(first) + "\n")
    t0 = time.time()
    while time.time() - t0 < 60:
        s = sub.next(2000)
        if s is None:
            break
        out.write(json.dumps(s) + "\n")
        out.flush()
        if s["samples_finished_total"] == 12 and s["running"] == 0:
            break
PY
sub_pid=$!
pids+=("$sub_pid")
for _ in $(seq 200); do [ -e "$dir/sub.ready" ] && break; kill -0 "$sub_pid" 2>/dev/null || break; sleep 0.05; done
[ -e "$dir/sub.ready" ] || fail "the Python subscriber got no snapshot"
$py - "$dir/p.txt" <<'PY'
import random, sys
r = random.Random(3)
with open(sys.argv[1], "w") as f:
    for i in range(6):
        f.write(",".join(["256"] + [str(r.randrange(256)) for _ in range(20 + 30 * i)]) + "\n")
PY
timeout 60 "$cli" --endpoint "tcp://127.0.0.1:$port" --timeout-ms 20000 generate --prompts "$dir/p.txt" --n 2 \
  --max-tokens 60 --temperature 1 --seed 5 > "$dir/g.jsonl" || fail "generate failed"
[ "$(wc -l < "$dir/g.jsonl")" -eq 12 ] || fail "expected 12 samples, got $(wc -l < "$dir/g.jsonl")"
sleep 0.5   # one more snapshot after the last sample (published every 200 ms)
wait "$sub_pid" || fail "the Python subscriber failed"
timeout 20 "$cli" --endpoint "tcp://127.0.0.1:$pport" --timeout-ms 5000 watch-metrics --count 1 > "$dir/watch.json" ||
  fail "watch-metrics got no snapshot"

get() { $py -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())' "$1"; }
get "http://127.0.0.1:$mport/metrics" > "$dir/metrics.txt" || fail "GET /metrics failed"
get "http://127.0.0.1:$mport/metrics.json" > "$dir/metrics.json" || fail "GET /metrics.json failed"
# the Prometheus text and the JSON say the same; the divergence is there
$py - "$dir/metrics.txt" "$dir/metrics.json" <<'PY' || fail "/metrics and /metrics.json disagree"
import json, sys
prom = {}
for line in open(sys.argv[1]):
    if line.startswith("#") or not line.strip():
        continue
    name, value = line.rsplit(" ", 1)
    prom[name] = float(value)
j = json.load(open(sys.argv[2]))
assert prom["fp4rollout_tokens_generated_total"] == j["tokens_generated_total"] > 0
assert prom["fp4rollout_samples_finished_total"] == j["samples_finished_total"] == 12
assert prom["fp4rollout_monitored_samples_total"] == j["monitored_samples_total"] == 12
v = j["divergence"][-1]
assert v["positions"] == j["tokens_generated_total"], (v, j["tokens_generated_total"])
key = 'fp4rollout_kl_mean_nats{version="%d",bucket="0-1K"}' % v["version"]
assert abs(prom[key] - v["buckets"][0]["kl_mean_nats"]) <= 1e-9 * max(1.0, abs(prom[key])), key
print("metrics: %d tokens, %d monitored samples, KL %.4g nats, top-1 %.4f" % (j["tokens_generated_total"],
      j["monitored_samples_total"], v["kl_mean_nats"], v["top1_agreement"]))
PY
# the PUB socket: the same object (only uptime and the rate move between snapshots)
$py - "$dir/sub.jsonl" "$dir/watch.json" "$dir/metrics.json" <<'PY' || fail "the PUB snapshots disagree with /metrics.json"
import json, sys
subs = [json.loads(l) for l in open(sys.argv[1])]
watch = json.load(open(sys.argv[2]))
j = json.load(open(sys.argv[3]))
moving = ("uptime_s", "tokens_per_second")
def same(a, b):
    return {k: v for k, v in a.items() if k not in moving} == {k: v for k, v in b.items() if k not in moving}
assert set(watch) == set(j), sorted(set(watch) ^ set(j))
assert same(watch, j), (watch, j)
assert same(subs[-1], j), (subs[-1], j)
done = [s["samples_finished_total"] for s in subs]
assert done == sorted(done) and done[0] < 12 == done[-1], done
print("PUB socket: %d snapshots seen by the subscriber (samples finished %d -> %d); the last one and "
      "watch-metrics equal /metrics.json" % (len(subs), done[0], done[-1]))
PY

browser=$(command -v chromium || command -v chromium-browser || true)
if [ -z "$browser" ]; then
  echo "serve_dashboard: SKIP browser part: chromium not found (scripts/install-deps.sh installs it)"
  echo "serve_dashboard: metrics checks passed"
  exit 0
fi
flags=(--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="$dir/chrome" --virtual-time-budget=6000)
timeout 90 "$browser" "${flags[@]}" --dump-dom "http://127.0.0.1:$mport/dashboard" > "$dir/dom.html" 2> "$dir/chrome.log" ||
  fail "chromium could not load the dashboard: $(tail -5 "$dir/chrome.log")"
timeout 90 "$browser" "${flags[@]}" --window-size=800,900 --screenshot="$dir/dashboard.png" \
  "http://127.0.0.1:$mport/dashboard" > /dev/null 2>> "$dir/chrome.log" || fail "chromium could not take a screenshot"
[ -s "$dir/dashboard.png" ] || fail "the screenshot is empty"
get "http://127.0.0.1:$mport/metrics.json" > "$dir/metrics2.json" || fail "GET /metrics.json failed"
$py - "$dir/dom.html" "$dir/metrics2.json" <<'PY' || fail "the dashboard shows other figures than /metrics"
import html.parser, json, sys
class Ids(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.cur, self.vals = None, {}
    def handle_starttag(self, tag, attrs):
        self.cur = dict(attrs).get("id")
    def handle_data(self, data):
        if self.cur and data.strip():
            self.vals[self.cur] = data.strip()
    def handle_endtag(self, tag):
        self.cur = None
p = Ids()
p.feed(open(sys.argv[1]).read())
j = json.load(open(sys.argv[2]))
shown = p.vals
checks = ["tokens_generated_total", "kv_blocks_used", "kv_blocks_free", "running", "waiting", "preemptions_total",
          "requests_total", "monitored_samples_total", "weight_version", "recalibrations_total",
          "last_recalibration_version"]
bad = [k for k in checks if k not in shown or float(shown[k]) != float(j[k])]
v = j["divergence"][-1]
for k, want in (("kl_mean_nats", v["kl_mean_nats"]), ("top1_agreement", v["top1_agreement"]),
                ("positions", v["positions"]), ("div_version", v["version"])):
    if k not in shown or abs(float(shown[k]) - float(want)) > 1e-9 * max(1.0, abs(float(want))):
        bad.append(k)
if shown.get("kv_dtype") != "nvfp4":
    bad.append("kv_dtype")
if bad:
    sys.exit("differ: " + ", ".join("%s shown %r, /metrics %r" % (k, shown.get(k), j.get(k)) for k in bad))
print("dashboard: %d figures equal /metrics (tokens %s, KL %s, top-1 %s)" % (len(checks) + 5,
      shown["tokens_generated_total"], shown["kl_mean_nats"], shown["top1_agreement"]))
PY
kill -TERM "$server_pid"
wait "$server_pid" || fail "the server did not exit cleanly"
server_pid=
echo "serve_dashboard: all checks passed (screenshot $(stat -c %s "$dir/dashboard.png") bytes)"
