#!/usr/bin/env bash
# The metrics endpoint of `fp4rollout serve` (docs/metrics.md) on loopback:
# a CPU server on synthetic:tiny with an NVFP4 cache, every sample monitored
# and a metrics_log serves 6 prompts x 2 samples; /metrics (Prometheus text)
# and /metrics.json agree, and the same snapshots arrive on the metrics PUB
# socket (a Python MetricsSubscriber that joined before the requests saw
# the counters grow; its last snapshot, and the one `fp4rollout-client
# watch-metrics` prints, equal /metrics.json). Then one weight update
# commits, one is refused (a corrupt bucket) and 6 more samples run on
# version 1: the Prometheus families (latency histograms, prompt tokens,
# finish reasons, weight updates, KL histograms by version) hold the counts
# the run implies, /health answers 200 serving and 503 paused, every query
# of docs/grafana-dashboard.json names an exported metric, /history.json
# holds both versions and both updates, and `fp4rollout dashboard` on the
# metrics_log serves the same history after the server is gone. A headless
# Chromium loads /dashboard: no script error, every chart has data, the
# headline equals /metrics.json; a screenshot is written to
# $DASHBOARD_SHOT (default $BUILD/serve_dashboard.png), its path printed.
# The browser part is skipped, with a message, when chromium is absent.
set -euo pipefail
name=serve_dashboard
source "$(dirname "$0")/serve_setup.bash"
port=$(free_port)
mport=$(free_port)
pport=$(free_port)
cat > "$dir/serve.json" <<JSON
{"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "nvfp4", "max_seqs": 8, "kl_sample_rate": 1.0,
 "metrics_port": $mport, "metrics_log": "$dir/run.jsonl", "metrics_pub_port": $pport, "coordinator": {"bind": "127.0.0.1", "port": $port}}
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


# ---- a weight update committed, one refused, and samples on version 1 ----
ep=tcp://127.0.0.1:$port
timeout 60 "$cli" --endpoint "$ep" push-weights --model synthetic:tiny:7 --version 1 > "$dir/push.json" ||
  fail "push-weights version 1 failed"
if timeout 60 "$cli" --endpoint "$ep" push-weights --model synthetic:tiny:7 --version 2 --corrupt-bucket 0 \
  > "$dir/bad.json" 2> "$dir/bad.err"; then
  fail "a weight update with a corrupt bucket was committed"
fi
timeout 60 "$cli" --endpoint "$ep" --timeout-ms 20000 generate --prompts "$dir/p.txt" --n 1 --first-id 100 \
  --max-tokens 40 --temperature 1 --seed 6 > "$dir/g1.jsonl" || fail "generate on version 1 failed"
[ "$(wc -l < "$dir/g1.jsonl")" -eq 6 ] || fail "expected 6 samples on version 1"
sleep 1.3   # a history point past the last sample (points span 1 s)
http_status() { $py - "$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    r = urllib.request.urlopen(sys.argv[1], timeout=10)
    print(r.status, r.read().decode().strip())
except urllib.error.HTTPError as e:
    print(e.code, e.read().decode().strip())
PY
}
[ "$(http_status "http://127.0.0.1:$mport/health")" = "200 serving" ] || fail "/health is not 200 while serving"
timeout 20 "$cli" --endpoint "$ep" pause --mode wait > /dev/null || fail "pause failed"
for _ in $(seq 25); do   # the next snapshot (every 200 ms) says paused
  h=$(http_status "http://127.0.0.1:$mport/health")
  [ "$h" = "503 paused" ] && break
  sleep 0.2
done
[ "$h" = "503 paused" ] || fail "/health while paused: $h"
timeout 20 "$cli" --endpoint "$ep" resume > /dev/null || fail "resume failed"
for _ in $(seq 25); do   # and the next one says serving again
  h=$(http_status "http://127.0.0.1:$mport/health")
  [ "$h" = "200 serving" ] && break
  sleep 0.2
done
[ "$h" = "200 serving" ] || fail "/health after resume: $h"
get "http://127.0.0.1:$mport/metrics" > "$dir/metrics3.txt" || fail "GET /metrics failed"
get "http://127.0.0.1:$mport/metrics.json" > "$dir/metrics3.json" || fail "GET /metrics.json failed"
get "http://127.0.0.1:$mport/history.json" > "$dir/history.json" || fail "GET /history.json failed"
$py - "$dir/metrics3.txt" "$dir/metrics3.json" "$dir/g.jsonl" "$dir/g1.jsonl" "$dir/p.txt" <<'PY' || fail "the Prometheus families disagree with the run"
import json, re, sys
prom, types = {}, {}
for line in open(sys.argv[1]):
    if line.startswith("# TYPE "):
        _, _, name, kind = line.split()
        types[name] = kind
    elif line.strip() and not line.startswith("#"):
        name, value = line.rsplit(" ", 1)
        prom[name] = float(value)
j = json.load(open(sys.argv[2]))
samples = [json.loads(l) for f in sys.argv[3:5] for l in open(f)]
prompts = [len(l.split(",")) for l in open(sys.argv[5])]
P = lambda k: prom["fp4rollout_" + k]
n = len(samples)   # 18
assert P("samples_finished_total") == n, P("samples_finished_total")
for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
    assert types["fp4rollout_" + h] == "histogram"
    assert P(h + "_count") == n and P(h + '_bucket{le="+Inf"}') == n, h
    assert P(h + "_sum") > 0, h
assert P("time_per_output_token_seconds_count") == sum(1 for s in samples if s["n_tokens"] >= 2)
# the client's own figures bound the server's: TTFT measured at the client includes the server's
assert P("time_to_first_token_seconds_sum") <= sum(s["ttft_ms"] for s in samples) * 1e-3 + 0.05
assert P("prompt_tokens_total") == 2 * sum(prompts), (P("prompt_tokens_total"), prompts)
assert P("generation_tokens_total") == P("tokens_generated_total") == sum(s["n_tokens"] for s in samples)
by = {r: sum(1 for s in samples if s["finish_reason"] == r) for r in ("stop", "length", "abort", "error")}
for r, c in by.items():
    assert P('requests_finished_total{finished_reason="%s"}' % r) == c, (r, c)
assert P('weight_updates_total{result="committed"}') == 1 and P('weight_updates_total{result="refused"}') == 1
assert P("weight_update_duration_seconds_count") == 1 and P("weight_update_duration_seconds_sum") > 0
used, free = P('kv_blocks{state="used"}'), P('kv_blocks{state="free"}')
assert abs(P("kv_cache_usage_ratio") - used / (used + free)) < 1e-6, (P("kv_cache_usage_ratio"), used, free)
assert P("num_requests_running") == 0 and P("num_requests_waiting") == 0
assert P("up") == 1 and any(k.startswith("fp4rollout_build_info{") for k in prom)
assert "fp4rollout_tokens_per_second" not in types, "a server-computed rate is no Prometheus metric"
div = {d["version"]: d for d in j["divergence"]}
assert sorted(div) == [0, 1], sorted(div)
for v, want in ((0, 12), (1, 6)):
    d = div[v]
    assert P('kl_nats_count{version="%d"}' % v) == d["positions"] > 0
    mean = P('kl_nats_sum{version="%d"}' % v) / d["positions"]
    assert abs(mean - d["kl_mean_nats"]) <= 1e-6 * abs(d["kl_mean_nats"]) + 1e-12, (mean, d)
    assert P('sample_kl_nats_count{version="%d"}' % v) == want
    agree = sum(P('top1_agreements_total{version="%d",bucket="%s"}' % (v, b["bucket"])) for b in d["buckets"])
    assert agree == round(d["top1_agreement"] * d["positions"]), (agree, d)
print("Prometheus: %d samples, TTFT sum %.3f s, %d prompt tokens, KL v0 %.3g v1 %.3g nats, updates 1 + 1 refused" %
      (n, P("time_to_first_token_seconds_sum"), P("prompt_tokens_total"), div[0]["kl_mean_nats"], div[1]["kl_mean_nats"]))
PY
# every Grafana panel queries metrics this server exports, each documented
$py - docs/grafana-dashboard.json "$dir/metrics3.txt" docs/metrics.md <<'PY' || fail "docs/grafana-dashboard.json names a metric that is not exported"
import json, re, sys
exported = {l.split()[2] for l in open(sys.argv[2]) if l.startswith("# TYPE ")}
doc = open(sys.argv[3]).read()
dash = json.load(open(sys.argv[1]))
panels, queries, bad = dash["panels"], 0, []
for p in panels:
    targets = p.get("targets", [])
    assert targets, "panel %r has no query" % p.get("title")
    for t in targets:
        names = re.findall(r"\bfp4rollout_[a-z0-9_]+", t["expr"])
        assert names, "query %r of panel %r names no fp4rollout metric" % (t["expr"], p["title"])
        queries += 1
        for n in names:
            base = re.sub(r"_(bucket|sum|count)$", "", n)
            fam = n if n in exported else (base if base in exported else None)
            if fam is None:
                bad.append("%s (panel %r)" % (n, p["title"]))
            elif "`%s`" % fam[len("fp4rollout_"):] not in doc:
                bad.append("%s is not in docs/metrics.md" % fam)
assert not bad, bad
print("grafana: %d panels, %d queries, every metric exported and documented" % (len(panels), queries))
PY
$py - "$dir/history.json" "$dir/metrics3.json" <<'PY' || fail "/history.json does not hold the run"
import json, sys
h = json.load(open(sys.argv[1]))
j = json.load(open(sys.argv[2]))
v = h["versions"]
assert v["version"] == [0, 1], v["version"]
div = {d["version"]: d for d in j["divergence"]}
for i, ver in enumerate(v["version"]):
    assert v["positions"][i] == div[ver]["positions"] and v["samples"][i] == (12, 6)[i], (i, v, div[ver])
    assert abs(v["kl_mean"][i] - div[ver]["kl_mean_nats"]) <= 1e-8 * abs(div[ver]["kl_mean_nats"]), (v, div[ver])
    assert v["kl_p50"][i] <= v["kl_p90"][i] <= v["kl_p99"][i]
assert h["syncs"]["committed"] == [1, 0] and h["syncs"]["version"] == [1, 1], h["syncs"]
p = h["points"]
assert len(p["t"]) >= 2 and sum(p["tokens"]) == j["tokens_generated_total"], (len(p["t"]), sum(p["tokens"]))
assert sum(p["kl_n"]) == sum(d["positions"] for d in j["divergence"])
assert p["weight_version"][0] == 0 and p["weight_version"][-1] == 1
l = h["latest"]
assert l["version"] == 1 and l["positions"] == div[1]["positions"] and sum(l["sample_kl"]["count"]) == 6
w = l["worst"]
assert len(w) == 5 and all(a["kl_mean"] >= b["kl_mean"] for a, b in zip(w, w[1:])), w
assert all(100 <= int(x["request_id"]) <= 105 for x in w), w   # the trainer's ids, not the server's
print("history: %d points over %.1f s, versions %s, %d weight updates" % (len(p["t"]), p["t"][-1] - p["t"][0],
      v["version"], len(h["syncs"]["t"])))
PY

browser=$(command -v chromium || command -v chromium-browser || true)
flags=(--headless --no-sandbox --disable-gpu --disable-dev-shm-usage --user-data-dir="$dir/chrome"
       --virtual-time-budget=5000 --enable-logging=stderr --v=0)
shot=${DASHBOARD_SHOT:-$build/serve_dashboard.png}
if [ -n "$browser" ]; then
  timeout 90 "$browser" "${flags[@]}" --window-size=1280,1900 --screenshot="$shot" \
    "http://127.0.0.1:$mport/dashboard" > /dev/null 2> "$dir/chrome.log" || fail "chromium could not take a screenshot"
  [ -s "$shot" ] || fail "the screenshot is empty"
  timeout 90 "$browser" "${flags[@]}" --dump-dom "http://127.0.0.1:$mport/dashboard" > "$dir/dom.html" \
    2>> "$dir/chrome.log" || fail "chromium could not load the dashboard: $(tail -5 "$dir/chrome.log")"
  # a console message of level error, or an uncaught exception, fails the page
  if grep -E 'CONSOLE[(:][0-9]+\)?\].*(Uncaught|Error)|:ERROR:CONSOLE' "$dir/chrome.log" > "$dir/console.txt"; then
    fail "the dashboard logged errors: $(head -3 "$dir/console.txt")"
  fi
  $py - "$dir/dom.html" "$dir/metrics3.json" <<'PY' || fail "the dashboard is incomplete or shows other figures than /metrics"
import html.parser, json, sys
class Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.stack, self.text, self.points = [], {}, {}
    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a and "data-points" in a:
            self.points[a["id"]] = int(a["data-points"])
        self.stack.append(a.get("id"))
    def handle_endtag(self, tag):
        if self.stack:
            self.stack.pop()
    def handle_data(self, data):
        for i in reversed(self.stack):
            if i:
                self.text[i] = self.text.get(i, "") + data
                break
p = Page()
p.feed(open(sys.argv[1]).read())
j = json.load(open(sys.argv[2]))
charts = ["c_kl_version", "c_kl_time", "c_buckets", "c_sample_hist", "c_tokens", "c_queue", "c_kv", "c_latency",
          "c_sync", "worst"]
empty = [c for c in charts if p.points.get(c, 0) <= 0]
assert not empty, "charts without data: %s" % empty
assert not p.text.get("errors", "").strip(), p.text["errors"]
d = {x["version"]: x for x in j["divergence"]}[1]
shown = {k: p.text.get(k, "").strip() for k in ("hl_version", "hl_kl", "hl_positions", "hl_top1", "tokens_total",
                                                 "weight_version", "kv_dtype")}
want = {"hl_version": "1", "hl_kl": "%.2e" % d["kl_mean_nats"], "hl_positions": "{:,}".format(d["positions"]),
        "hl_top1": "%.1f%%" % (100 * d["top1_agreement"]), "tokens_total": "{:,}".format(j["tokens_generated_total"]),
        "weight_version": "1", "kv_dtype": "nvfp4"}
want["hl_kl"] = want["hl_kl"].replace("e-0", "e-").replace("e+0", "e+")
bad = {k: (shown[k], want[k]) for k in want if shown[k] != want[k]}
assert not bad, bad
print("dashboard: %d charts with data (%s); headline: version %s, KL %s nats over %s positions, top-1 %s" % (
      len(charts), ", ".join("%s %d" % (c, p.points[c]) for c in charts), shown["hl_version"], shown["hl_kl"],
      shown["hl_positions"], shown["hl_top1"]))
PY
else
  echo "serve_dashboard: SKIP browser part: chromium not found (scripts/install-deps.sh installs it)"
fi
get "http://127.0.0.1:$mport/history.json" > "$dir/history_live.json" || fail "GET /history.json failed"
kill -TERM "$server_pid"
wait "$server_pid" || fail "the server did not exit cleanly"
server_pid=

# ---- the same history, offline, from the metrics_log ----
dport=$(free_port)
"$bin" dashboard "$dir/run.jsonl" --port "$dport" > "$dir/dashboard.log" 2>&1 &
pids+=($!)
for _ in $(seq 100); do grep -q "dashboard of" "$dir/dashboard.log" && break; sleep 0.05; done
grep -q "on http://127.0.0.1:$dport/dashboard" "$dir/dashboard.log" || fail "fp4rollout dashboard did not start"
get "http://127.0.0.1:$dport/history.json" > "$dir/history_file.json" || fail "GET /history.json (offline) failed"
[ "$(http_status "http://127.0.0.1:$dport/metrics" | cut -d' ' -f1)" = 404 ] || fail "offline /metrics is not 404"
$py - "$dir/history_live.json" "$dir/history_file.json" <<'PY' || fail "the offline dashboard's history differs"
import json, sys
live, off = (json.load(open(f)) for f in sys.argv[1:3])
assert off["versions"] == live["versions"], (off["versions"], live["versions"])
assert off["syncs"] == live["syncs"] and off["latest"] == live["latest"]
k = min(len(off["points"]["t"]), len(live["points"]["t"]) - 1)   # live ends with the interval still summing
assert k >= 2 and all(off["points"][f][:k] == live["points"][f][:k] for f in live["points"]), k
print("offline: fp4rollout dashboard serves the same %d versions, %d updates and %d points" %
      (len(off["versions"]["version"]), len(off["syncs"]["t"]), k))
PY
echo "serve_dashboard: all checks passed${browser:+ (screenshot: $shot)}"
