#!/usr/bin/env bash
# The metrics endpoint of `fp4rollout serve` (docs/metrics.md) on loopback:
# a CPU server on synthetic:tiny with an NVFP4 cache and every sample
# monitored serves 6 prompts x 2 samples; then /metrics (Prometheus text)
# and /metrics.json agree, and a headless Chromium loads /dashboard, runs
# its script, and the figures the page shows (health, and the divergence of
# the weight version serving) equal /metrics; a screenshot is taken. The
# browser part is skipped, with a message, when chromium is absent.
set -euo pipefail
name=serve_dashboard
source "$(dirname "$0")/serve_setup.bash"
port=$(free_port)
mport=$(free_port)
cat > "$dir/serve.json" <<JSON
{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "nvfp4", "max_seqs": 8, "kl_sample_rate": 1.0,
 "metrics_port": $mport, "coordinator": {"bind": "127.0.0.1", "port": $port}}
JSON
"$bin" serve --config "$dir/serve.json" 2> "$dir/serve.log" &
server_pid=$!
for _ in $(seq 200); do
  grep -q "listening on" "$dir/serve.log" 2>/dev/null && break
  kill -0 "$server_pid" 2>/dev/null || fail "the server exited at start"
  sleep 0.05
done
grep -q "metrics on http://127.0.0.1:$mport/metrics" "$dir/serve.log" || fail "no metrics endpoint announced"
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
          "requests_total", "monitored_samples_total", "weight_version"]
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
