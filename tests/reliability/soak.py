"""The soak (tests/reliability/README.md): for --seconds, clients stream
requests with aborts while a trainer pushes weight updates, and faults are
injected in turn (a client killed mid-stream, a trainer killed mid-update, a
malformed-message storm, an oversized frame, a prompt beyond the window, an
idle-connection flood on the metrics port). At the end: every sample of
every surviving client ended exactly once, and the server's resident memory
and open descriptors are compared with their values after warm-up.
Prints the figures as one JSON line and a Markdown table row."""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from harness import BIN, Raw, Server, free_port, idle_connections, pack, tmpdir  # noqa: E402

CLI = os.path.join(os.path.dirname(BIN), "fp4rollout-client")


class Client:
    """A rollout client keeping count of what it asked and what ended."""

    def __init__(self, endpoint, rng):
        self.c = Raw(endpoint)
        self.rng = rng
        self.next_id = 0
        self.open = {}       # request id -> samples not yet done
        self.done = 0
        self.submitted = 0
        self.msgs_in = self.msgs_out = 0
        self.dup = 0

    def submit(self):
        rid, n = self.next_id, self.rng.randint(1, 4)
        self.next_id += 1
        prompt = [256] + [self.rng.randrange(256) for _ in range(self.rng.randint(2, 40))]
        self.c.send({"type": "generate", "request_id": rid, "prompt": prompt, "n": n, "temperature": 1.0,
                     "max_tokens": self.rng.randint(4, 64), "stop_token_ids": []})
        self.open[rid] = set(range(n))
        self.submitted += n
        self.msgs_out += 1

    def maybe_abort(self):
        if self.open and self.rng.random() < 0.2:
            rid = self.rng.choice(list(self.open))
            self.c.send({"type": "abort", "request_ids": [rid]})
            self.msgs_out += 1

    def drain(self, ms=0):
        while True:
            m = self.c.recv(ms)
            ms = 0
            if m is None:
                return
            self.msgs_in += 1
            if m["type"] == "done":
                left = self.open.get(m["request_id"])
                if left is None or m["sample"] not in left:
                    self.dup += 1
                    continue
                left.discard(m["sample"])
                self.done += 1
                if not left:
                    del self.open[m["request_id"]]
            elif m["type"] == "error":
                raise SystemExit(f"soak: unexpected error: {m}")


def rss_fds(pid):
    rss = next(int(line.split()[1]) for line in open(f"/proc/{pid}/status") if line.startswith("VmRSS:"))
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def kill_client_mid_stream(srv, rng):
    c = Raw(srv.endpoint)
    c.send({"type": "generate", "request_id": 1, "prompt": [256, 1, 2], "n": 2, "max_tokens": 4000,
            "stop_token_ids": []})
    c.recv(5000)
    c.close()


def kill_trainer_mid_update(srv, rng, state):
    p = subprocess.Popen([CLI, "--endpoint", srv.endpoint, "push-weights", "--model", "synthetic:tiny:7",
                          "--version", str(state["version"] + 1000000), "--bucket-bytes", "65536"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(rng.uniform(0.01, 0.1))
    p.send_signal(signal.SIGKILL)
    p.wait()


def push_weights(srv, rng, state):
    probe = Raw(srv.endpoint)   # a killed trainer's update may have committed before it died
    state["version"] = max(state["version"], probe.call({"type": "stats"}, "stats_reply")["server"]["weight_version"])
    probe.close()
    v = state["version"] + 1
    r = subprocess.run([CLI, "--endpoint", srv.endpoint, "--timeout-ms", "60000", "push-weights", "--model",
                        f"synthetic:tiny:{rng.randint(1, 9)}", "--version", str(v), "--bucket-bytes", "262144"],
                       capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        state["version"] = v
        state["updates"] += 1
    else:
        state["update_failures"] += 1


def malformed_storm(srv, rng):
    c = Raw(srv.endpoint)
    n = 500
    for _ in range(n):
        c.send(bytes(rng.randrange(256) for _ in range(rng.randint(1, 48))))
    got = 0
    while got < n and c.recv(5000) is not None:
        got += 1
    c.close()
    if got != n:
        raise SystemExit(f"soak: {got} errors for {n} malformed messages")


def oversized_frame(srv, rng):
    c = Raw(srv.endpoint)
    c.send(b"\x00" * (8 << 20))
    time.sleep(0.2)
    c.close()


def huge_prompt(srv, rng):
    c = Raw(srv.endpoint)
    c.send({"type": "generate", "request_id": 1, "prompt": [1] * (1 << 20)})
    m = c.recv(10000)
    c.close()
    if not m or m.get("code") != "bad_message":
        raise SystemExit(f"soak: a prompt beyond the window got {m}")


def http_flood(srv, rng, mport):
    socks = idle_connections(mport, 300)
    time.sleep(0.3)
    for s in socks:
        s.close()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, required=True)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--fault-every", type=float, default=2.0)
    args = ap.parse_args()
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    rng = random.Random(2026)
    wd = tmpdir()
    mport = free_port()
    srv = Server(wd, "soak", max_seqs=32, metrics_port=mport,
                 coordinator={"max_message_bytes": 4 << 20},
                 metrics_http={"max_connections": 32, "idle_timeout_s": 2})
    clients = [Client(srv.endpoint, random.Random(i)) for i in range(args.clients)]
    state = {"version": 0, "updates": 0, "update_failures": 0}
    faults = {k: 0 for k in ("client_killed", "trainer_killed", "malformed_storm", "oversized_frame",
                             "huge_prompt", "http_flood", "weight_update")}
    kinds = list(faults)
    warm = time.time() + min(10.0, args.seconds / 10)
    start = end_warm = None
    t_end = time.time() + args.seconds
    next_fault = time.time() + args.fault_every
    k = 0
    try:
        while time.time() < t_end:
            for c in clients:
                while len(c.open) < 6:
                    c.submit()
                c.maybe_abort()
                c.drain(5)
            if start is None and time.time() >= warm:
                start = rss_fds(srv.pid())
                end_warm = time.time()
            if time.time() >= next_fault:
                kind = kinds[k % len(kinds)]
                k += 1
                if kind == "client_killed":
                    kill_client_mid_stream(srv, rng)
                elif kind == "trainer_killed":
                    kill_trainer_mid_update(srv, rng, state)
                elif kind == "malformed_storm":
                    malformed_storm(srv, rng)
                elif kind == "oversized_frame":
                    oversized_frame(srv, rng)
                elif kind == "huge_prompt":
                    huge_prompt(srv, rng)
                elif kind == "http_flood":
                    http_flood(srv, rng, mport)
                else:
                    push_weights(srv, rng, state)
                faults[kind] += 1
                next_fault = time.time() + args.fault_every
            if srv.proc.poll() is not None:
                raise SystemExit("soak: the server died: " + srv.log_text()[-800:])
        deadline = time.time() + 120
        while any(c.open for c in clients) and time.time() < deadline:
            for c in clients:
                c.drain(20)
        time.sleep(4)   # idle connections time out, departed clients are dropped
        end = rss_fds(srv.pid())
        probe = Raw(srv.endpoint)
        stats = probe.call({"type": "stats"}, "stats_reply")
        probe.close()
    finally:
        for c in clients:
            c.c.close()
        srv.stop()
    lost = sum(sum(len(v) for v in c.open.values()) for c in clients)
    fig = {"seconds": args.seconds, "clients": args.clients,
           "messages_in": stats["server"]["messages_in"], "messages_out": stats["server"]["messages_out"],
           "samples_submitted": sum(c.submitted for c in clients), "samples_done": sum(c.done for c in clients),
           "samples_lost": lost, "duplicate_dones": sum(c.dup for c in clients),
           "updates_committed": state["updates"], "update_push_failures": state["update_failures"],
           "weight_version": stats["server"]["weight_version"], "faults": faults,
           "faults_total": sum(faults.values()), "clients_departed": stats["server"].get("clients_departed"),
           "rss_kb_start": start[0] if start else None, "rss_kb_end": end[0],
           "fds_start": start[1] if start else None, "fds_end": end[1],
           "open_requests_end": stats["server"]["open_requests"], "running_end": stats["scheduler"]["running"]}
    print(json.dumps(fig))
    ok = (lost == 0 and fig["duplicate_dones"] == 0 and fig["open_requests_end"] == 0 and fig["running_end"] == 0
          and start is not None and end[1] <= start[1] + 4 and end[0] <= start[0] * 1.25 + 16384)
    print(f"| {args.seconds:.0f} s | {fig['messages_in']:,} in / {fig['messages_out']:,} out | "
          f"{fig['samples_done']:,} of {fig['samples_submitted']:,} | {fig['updates_committed']} | "
          f"{fig['faults_total']} | {fig['rss_kb_start'] // 1024 if start else '?'} -> {fig['rss_kb_end'] // 1024} MiB | "
          f"{fig['fds_start']} -> {fig['fds_end']} | {lost} |")
    print("soak: " + ("passed" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
