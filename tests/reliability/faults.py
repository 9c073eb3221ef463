"""Fault scenarios against `fp4rollout serve` (tests/reliability/README.md).
Each scenario starts from a running server, injects one fault and checks
that every sample is accounted for, the server keeps serving, and memory
and descriptors stay flat. Prints "ok NAME" or "FAIL NAME: why" per
scenario and ends with "N passed, N failed".

usage: faults.py [--only NAME[,NAME...]] [--list]
BUILD (environment) is the build folder (default build)."""
import argparse
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
import faults_pause  # noqa: E402
from harness import (BIN, BUILD, ROOT, Failure, Raw, Server, check, collect, idle_connections, pack, tmpdir,  # noqa: E402
                     wait_for)

CLI = os.path.join(os.path.dirname(BIN), "fp4rollout-client")
# As long as synthetic:tiny's window (4096) lets a sample of a short prompt run: longer
# is refused (docs/protocol.md, generate's max_tokens).
LONG = {"max_tokens": 4000, "stop_token_ids": [], "temperature": 1.0}
SCENARIOS = []


def scenario(fn):
    SCENARIOS.append(fn)
    return fn


def gen(c, rid, n=1, prompt=(256, 1, 2, 3), **kw):
    c.send(dict({"type": "generate", "request_id": rid, "prompt": list(prompt), "n": n}, **kw))


def first_tokens(c, timeout_ms=10000):
    end = time.time() + timeout_ms / 1000
    while time.time() < end:
        m = c.recv(1000)
        if m and m["type"] == "tokens":
            return m
        if m and m["type"] == "error":
            raise Failure(f"error instead of tokens: {m}")
    raise Failure("no tokens arrived")


def idle(srv, probe, timeout_s):
    """True once the server has nothing open and nothing running."""
    def done():
        s = probe.stats()
        return s["server"]["open_requests"] == 0 and s["scheduler"]["running"] == 0 and s
    return wait_for(done, timeout_s, 0.1)


def tensor_list():
    out = subprocess.run([CLI, "push-weights", "--model", "synthetic:tiny", "--version", "1", "--export", os.devnull],
                         capture_output=True, text=True, check=True).stdout
    import json
    ts = [json.loads(line) for line in out.splitlines() if line.strip()]
    return [{"name": t["name"], "dtype": "f32", "shape": t["shape"]} for t in ts]


def begin_msg(version, tensors):
    total = sum(4 * eval("*".join(map(str, t["shape"]))) for t in tensors)
    return {"type": "update_weights_begin", "version": version, "tensors": tensors, "total_bytes": total,
            "bucket_bytes": 1 << 20}


# ---- 1. departed clients ----------------------------------------------------

@scenario
def departed_close(env):
    """A client that closes its socket mid-stream: its samples end within the
    heartbeat timeout, with one log line and the departed count."""
    srv, probe = env.srv, env.probe
    before = probe.stats()["server"].get("clients_departed", 0)
    a = Raw(srv.endpoint)
    gen(a, 1, n=2, **LONG)
    first_tokens(a)
    a.close()
    s = idle(srv, probe, 3)
    check(s, "the departed client's samples still run 3 s after it closed its socket")
    check(s["server"].get("clients_departed", 0) > before, "clients_departed did not grow")
    check("disconnected" in srv.log_text(), "no log line names the departed client")


@scenario
def departed_takeover(env):
    """A new connection with a departed client's routing id gets nothing of
    its stream and cannot abort its requests."""
    srv, probe = env.srv, env.probe
    a = Raw(srv.endpoint, routing_id=b"victim-1")
    gen(a, 7, n=2, **LONG)
    first_tokens(a)
    a.close()
    time.sleep(0.5)
    with Raw(srv.endpoint, routing_id=b"victim-1") as b:
        r = b.call({"type": "abort", "request_ids": [7]}, "abort_reply")
        check(r["type"] == "abort_reply" and r["not_found"] == [7], f"the new connection could abort: {r}")
        stray = [m for m in b.other if m["type"] in ("tokens", "done")]
        end = time.time() + 0.5
        while time.time() < end:
            m = b.recv(100)
            if m and m["type"] in ("tokens", "done"):
                stray.append(m)
        check(not stray, f"the new connection received {len(stray)} messages of the departed client's stream")
    check(idle(srv, probe, 3), "samples still open")


@scenario
def departed_frozen(env):
    """A client process frozen by SIGSTOP (its connection stays open, silent):
    the heartbeat timeout closes it and its samples end."""
    srv, probe = env.srv, env.probe
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); from harness import Raw; "
            "c = Raw(sys.argv[1]); c.send({'type': 'generate', 'request_id': 1, 'prompt': [256, 5], 'n': 2, "
            "'max_tokens': 4000, 'stop_token_ids': []}); m = c.recv(10000); print(m['type'], flush=True); "
            "time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, srv.endpoint, os.path.dirname(__file__)],
                         stdout=subprocess.PIPE, text=True)
    try:
        check(p.stdout.readline().strip() == "tokens", "the frozen client got no tokens")
        p.send_signal(signal.SIGSTOP)
        t0 = time.time()
        s = idle(srv, probe, 6)
        check(s, "a frozen client's samples still run 6 s later (heartbeat timeout 1 s)")
        check(time.time() - t0 < 5, f"took {time.time() - t0:.1f} s")
    finally:
        p.kill()
        p.wait()


@scenario
def trainer_killed_mid_update(env):
    """A trainer killed mid-update: the update is dropped at once, not after
    the idle timeout, and the old weights serve on."""
    srv, probe = env.srv, env.probe
    code = ("import sys, time; sys.path.insert(0, sys.argv[2]); import json; from harness import Raw; "
            "c = Raw(sys.argv[1]); c.send(json.loads(sys.argv[3])); m = c.recv(10000); print(m['type'], flush=True); "
            "time.sleep(60)")
    import json
    p = subprocess.Popen([sys.executable, "-c", code, srv.endpoint, os.path.dirname(__file__),
                          json.dumps(dict(begin_msg(100, env.tensors), v=1))], stdout=subprocess.PIPE, text=True)
    try:
        check(p.stdout.readline().strip() == "update_weights_reply", "the update did not begin")
        check(probe.stats()["server"]["updating"], "no update in progress after its begin")
        p.kill()
        t0 = time.time()
        ok = wait_for(lambda: not probe.stats()["server"]["updating"], 3, 0.1)
        check(ok, f"the dead trainer's update still staged {time.time() - t0:.1f} s after it died")
        check("its client disconnected" in srv.log_text(), "the log does not say why the update was dropped")
    finally:
        p.kill()
        p.wait()


# ---- 2. UTF-8 ------------------------------------------------------------------

def raw_map(*pairs):
    """A msgpack map built by hand, so keys and strings can hold any bytes."""
    out = bytes([0x80 | len(pairs)])
    for k, v in pairs:
        for x in (k, v):
            if isinstance(x, bytes):
                out += bytes([0xa0 | len(x)]) + x if len(x) < 32 else bytes([0xd9, len(x)]) + x
            else:
                out += pack(x)
    return out


@scenario
def utf8(env):
    """Invalid UTF-8 in a type, a key or a string: bad_message, and the error
    itself is valid UTF-8 (a strict decoder reads it)."""
    with Raw(env.srv.endpoint) as c:
        cases = [("type", raw_map((b"type", b"\xff\xfe"), (b"v", 1))),
                 ("key", raw_map((b"type", b"stats"), (b"v", 1), (b"\xc3\x28", 1))),
                 ("hello client", raw_map((b"type", b"hello"), (b"v", 1), (b"client", b"ab\xed\xa0\x80")))]
        for what, data in cases:
            c.send(data)
            frame = c.recv(5000, raw=True)
            check(frame is not None, f"{what}: no reply")
            try:
                m = __import__("msgpack").unpackb(frame, raw=False)
            except Exception as e:  # noqa: BLE001
                raise Failure(f"{what}: the reply is not valid UTF-8 msgpack: {e}: {frame[:80]!r}")
            check(m["type"] == "error" and m["code"] == "bad_message", f"{what}: {m}")


# ---- 4. bounds ------------------------------------------------------------------

@scenario
def huge_prompt(env):
    """A prompt of 4M entries (far beyond the window) is refused before it is
    unpacked: bad_message at once, memory flat."""
    srv = env.srv
    with Raw(srv.endpoint) as c:
        rss0 = srv.rss_kb()
        t0 = time.time()
        gen(c, 20, prompt=[1] * (4 << 20))
        m = c.recv(20000)
        dt = time.time() - t0
        check(m and m["type"] == "error" and m["code"] == "bad_message", f"reply {m and m.get('code')}: {m}")
        check("array" in m["message"], f"message {m['message']!r}")
        time.sleep(0.2)
        grew = (srv.rss_kb() - rss0) / 1024
        check(grew < 24, f"resident memory grew {grew:.0f} MiB after the refusal")
        check(dt < 2, f"took {dt:.1f} s")


@scenario
def oversized_frame(env):
    """A frame over max_message_bytes: ZeroMQ drops the sender's connection
    without reading it, a bystander's stream goes on, memory stays flat."""
    srv = Server(env.dir, "small", coordinator={"max_message_bytes": 1 << 20})
    try:
        by = Raw(srv.endpoint)
        gen(by, 1, n=2, max_tokens=200, stop_token_ids=[], temperature=1.0)
        time.sleep(0.2)
        rss0 = srv.rss_kb()
        bad = Raw(srv.endpoint)
        bad.send(b"\x00" * (64 << 20))
        reply = bad.recv(1500)
        check(reply is None, f"the 64 MiB frame was read and answered: {reply}")
        got = collect(by, [1], 2, 60)
        check(all(d["finish_reason"] == "length" for d in got.values()), "the bystander's samples did not finish")
        grew = (srv.rss_kb() - rss0) / 1024
        check(grew < 24, f"resident memory grew {grew:.0f} MiB")
        h = Raw(srv.endpoint)
        check(h.call({"type": "hello"}, "hello_reply")["type"] == "hello_reply", "no hello after the frame")
        for x in (by, bad, h):
            x.close()
    finally:
        srv.stop()


# ---- 5. error texts -------------------------------------------------------------

@scenario
def error_texts(env):
    """Errors name the client's request id, print uint64 values as sent and
    floats to the digit that matters."""
    with Raw(env.srv.endpoint) as c:
        r = c.call({"type": "generate", "request_id": 20, "prompt": [272]}, "error")
        check("request 20:" in r["message"] and r.get("request_id") == 20, f"vocabulary: {r['message']!r}")
        r = c.call({"type": "generate", "request_id": 21, "prompt": [1], "top_p": 1.0000001}, "error")
        check("1.0000001" in r["message"], f"top_p: {r['message']!r}")
        r = c.call({"type": "generate", "request_id": 22, "prompt": [1], "n": 2 ** 64 - 1}, "error")
        check("18446744073709551615" in r["message"], f"n: {r['message']!r}")


# ---- 8. docs against behaviour --------------------------------------------------

@scenario
def missing_version(env):
    """A message without "v" gets unsupported_version, as the doc says."""
    with Raw(env.srv.endpoint) as c:
        c.send(pack({"type": "hello"}))
        m = c.recv(5000)
        check(m and m["type"] == "error" and m["code"] == "unsupported_version", f"{m}")


@scenario
def held_abort_counts_finished(env):
    """Samples of a held request ended by abort count in scheduler.finished."""
    c = Raw(env.srv.endpoint)
    try:
        check(c.call({"type": "pause", "mode": "wait"}, "pause_reply")["type"] == "pause_reply", "pause")
        f0 = c.stats()["scheduler"]["finished"]
        gen(c, 5, n=3)
        r = c.call({"type": "abort", "request_ids": [5]}, "abort_reply")
        check(r["samples"] == 3, f"abort: {r}")
        f1 = c.stats()["scheduler"]["finished"]
        check(f1 - f0 == 3, f"finished grew by {f1 - f0} for 3 aborted held samples")
    finally:
        c.call({"type": "resume"}, "resume_reply")
        c.close()


# ---- 6. one update at a time ----------------------------------------------------

@scenario
def update_owned(env):
    """A begin from another client is refused and leaves the update in
    progress alone (a refused begin too)."""
    a, b = Raw(env.srv.endpoint), Raw(env.srv.endpoint)
    try:
        r = a.call(begin_msg(200, env.tensors), "update_weights_reply")
        check(r["type"] == "update_weights_reply", f"begin: {r}")
        r = b.call(begin_msg(201, env.tensors), "update_weights_reply")
        check(r["type"] == "error" and r["code"] == "update_state", f"the second begin: {r}")
        r = b.call(dict(begin_msg(1, env.tensors)), "update_weights_reply")
        check(r["type"] == "error", f"a refused begin: {r}")
        s = a.stats()["server"]
        check(s["updating"] and s["update_version"] == 200, f"the first update was dropped: {s}")
        r = a.call({"type": "update_weights_abort", "version": 200}, "update_weights_reply")
        check(r["type"] == "update_weights_reply", f"abort: {r}")
        r = a.call(dict(begin_msg(202, env.tensors), bucket_bytes=4 << 30), "update_weights_reply")
        check(r["type"] == "error" and r["code"] == "bad_bucket", f"buckets over the frame limit: {r}")
    finally:
        a.close()
        b.close()


# ---- 3. the metrics endpoint ----------------------------------------------------

def http_get(port, path="/metrics", token=None, timeout=5):
    """(status, body); status 0 when no answer came."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


@scenario
def http_idle_flood(env):
    """1,100 idle connections to the metrics port: the endpoint holds at most
    its limit, closes an idle connection after its timeout, never logs
    FD_SETSIZE, and answers at once when the flood goes."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    mport = __import__("harness").free_port()
    srv = Server(env.dir, "http", metrics_port=mport, metrics_http={"max_connections": 32, "idle_timeout_s": 2})
    socks = []
    try:
        check(http_get(mport)[0] == 200, "no /metrics at start")
        fd0 = srv.fds()
        first = socket.create_connection(("127.0.0.1", mport))
        first.settimeout(5)
        t0 = time.time()
        socks = idle_connections(mport, 1100)
        time.sleep(0.5)
        check(srv.fds() <= fd0 + 40, f"the server holds {srv.fds() - fd0} more descriptors (limit 32)")
        try:
            eof = first.recv(1) == b""
        except (socket.timeout, ConnectionResetError):
            eof = False
        check(eof and time.time() - t0 < 4.5, f"an idle connection was not closed after 2 s ({time.time() - t0:.1f} s)")
        first.close()
        check("FD_SETSIZE" not in srv.log_text(), "the log names FD_SETSIZE")
        for s in socks:
            s.close()
        socks = []
        ok = wait_for(lambda: http_get(mport, timeout=2)[0] == 200, 5, 0.2)
        check(ok, "GET /metrics fails after the flood went")
        check(srv.log_text().count("\n") < 40, "the refused connections flooded the log")
    finally:
        for s in socks:
            s.close()
        srv.stop()


# ---- 6. roles -------------------------------------------------------------------

@scenario
def no_curve_loopback_only(env):
    """Without CURVE every client is a trainer, so the server refuses to
    bind anything but loopback, and says so at start."""
    try:
        srv = Server(env.dir, "open", coordinator={"bind": "0.0.0.0"})
        srv.stop()
        raise Failure("a server without CURVE bound 0.0.0.0")
    except Failure as e:
        check("not a loopback address" in str(e), f"{e}")
    check("every client has the trainer role" in env.srv.log_text(), "the start log does not name the roles")


@scenario
def curve_roles(env):
    """With CURVE, trainer keys may update weights and pause; rollout-client
    keys may generate but get forbidden for those; refused handshakes are
    logged once a second at most; the metrics endpoint wants a token."""
    import zmq
    spub, ssec = (k.decode() for k in zmq.curve_keypair())
    tpub, tsec = (k.decode() for k in zmq.curve_keypair())
    rpub, rsec = (k.decode() for k in zmq.curve_keypair())
    xpub, xsec = (k.decode() for k in zmq.curve_keypair())
    mport = __import__("harness").free_port()
    srv = Server(env.dir, "curve", curve={"server_secret_key": ssec, "client_public_keys": [rpub],
                                          "trainer_public_keys": [tpub]},
                 metrics_port=mport, metrics_http={"token": "s3cret"})
    try:
        t = Raw(srv.endpoint, curve=(spub, tpub, tsec))
        r = Raw(srv.endpoint, curve=(spub, rpub, rsec))
        check(r.call({"type": "hello"}, "hello_reply")["type"] == "hello_reply", "the rollout client got no hello")
        for msg, want in (({"type": "pause", "mode": "abort"}, "pause_reply"),
                          (begin_msg(5, env.tensors), "update_weights_reply"),
                          ({"type": "update_weights_abort", "version": 5}, "update_weights_reply")):
            m = r.call(msg, want)
            check(m["type"] == "error" and m["code"] == "forbidden", f"rollout client, {msg['type']}: {m}")
        gen(r, 1, n=2, max_tokens=8)
        got = collect(r, [1], 2, 30)
        check(len(got) == 2, "the rollout client's generate")
        check(t.call({"type": "pause", "mode": "wait"}, "pause_reply")["type"] == "pause_reply", "trainer pause")
        check(t.call({"type": "resume"}, "resume_reply")["type"] == "resume_reply", "trainer resume")
        strangers = [Raw(srv.endpoint, curve=(spub, xpub, xsec)) for _ in range(30)]
        for x in strangers:
            x.send({"type": "hello"})
        time.sleep(1.5)
        for x in strangers:
            check(x.recv(10) is None, "a client with an unlisted key was answered")
            x.close()
        refusals = srv.log_text().count("refused a client")
        check(1 <= refusals <= 3, f"{refusals} log lines for 30 refused handshakes in 1.5 s")
        check(http_get(mport)[0] == 401, "the metrics endpoint answered without the token")
        check(http_get(mport, token="s3cret")[0] == 200, "the metrics endpoint refused the token")
        t.close()
        r.close()
    finally:
        srv.stop()


# ---- 7. a lost rank ---------------------------------------------------------------

def mpirun():
    import shutil
    if not shutil.which("mpirun"):
        return None
    cmd = ["mpirun", "--oversubscribe", "-x", "OPENBLAS_NUM_THREADS", "-np", "2"]
    if os.geteuid() == 0:
        cmd.insert(1, "--allow-run-as-root")
    return cmd


def rank_pid(root_pid, rank):
    """The pid of the fp4rollout process of world rank `rank` under root_pid."""
    todo, seen = [root_pid], []
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            todo += [int(c) for c in open(f"/proc/{p}/task/{p}/children").read().split()]
        except OSError:
            pass
    for p in seen:
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            exe = os.readlink(f"/proc/{p}/exe")
        except OSError:
            continue
        if exe.endswith("fp4rollout") and f"OMPI_COMM_WORLD_RANK={rank}".encode() in env:
            return p
    return None


def lost_rank(env, sig, rank):
    launcher = mpirun()
    if not launcher:
        print(f"     SKIP: mpirun not found", flush=True)
        return
    srv = Server(env.dir, f"mpi{sig}", launcher=launcher, coordinator={"rank_timeout_s": 2})
    try:
        c = Raw(srv.endpoint)
        for r in range(4):
            gen(c, r, n=2, prompt=[256, r, 7], **LONG)
        first_tokens(c, 20000)
        pid = rank_pid(srv.pid(), rank)
        check(pid, f"no process of rank {rank}")
        os.kill(pid, sig)
        t0 = time.time()
        # A request still on the socket when the rank was lost (a slow
        # client, a busy machine) is answered with an error reply instead.
        dones, end = {}, time.time() + 20
        while len(dones) < 8 and time.time() < end:
            m = c.recv(500)
            if m and m["type"] == "done":
                dones[(m["request_id"], m["sample"])] = m["finish_reason"]
            elif m and m["type"] == "error" and m.get("request_id") in range(4):
                check(m["code"] == "shutdown", f"error reply {m}")
                dones.update({(m["request_id"], k): "refused" for k in range(2)})
        check(len(dones) == 8, f"{len(dones)} of 8 open samples got their done after rank {rank} got signal {sig}; "
                               f"server log:\n{srv.log_text()[-2500:]}")
        check(all(v in ("error", "refused") for v in dones.values()), f"finish reasons {sorted(set(dones.values()))}")
        check(time.time() - t0 < 10, f"took {time.time() - t0:.1f} s")
        c.close()
        if sig == signal.SIGSTOP:
            os.kill(pid, signal.SIGKILL)
    finally:
        srv.stop()


@scenario
def lost_rank_stopped(env):
    """mpirun -np 2, rank 1 stopped (SIGSTOP): after rank_timeout_s every
    open sample gets a done with reason error and the job ends."""
    lost_rank(env, signal.SIGSTOP, 1)


@scenario
def lost_rank_killed(env):
    """mpirun -np 2, rank 1 killed (SIGKILL): every open sample gets a done
    with reason error before the job ends."""
    lost_rank(env, signal.SIGKILL, 1)


@scenario
def client_notices_lost_server(env):
    """The Python client (over the C library) notices a killed server within
    its heartbeat timeout, names the samples that will not end, and
    resubmits them to a restarted server on the same port."""
    sys.path.insert(0, os.path.join(ROOT, "trainer_bridge", "client", "python"))
    from fp4rollout_client import ClientError, RolloutClient
    srv = Server(env.dir, "lost1")
    port = srv.port
    with RolloutClient(srv.endpoint, timeout_ms=20000) as c:
        try:
            for r in (41, 42):
                c.submit([256, r, 3], n=2, max_tokens=1000, stop_token_ids=[], temperature=1.0, request_id=r)
            next(iter(c.events()))   # streaming: far from their ends
            srv.proc.kill()
            srv.proc.wait()
            t0 = time.time()
            try:
                got = list(c.results())
                raise Failure(f"results() ended without an error ({len(got)} samples) after the server died")
            except ClientError as e:
                msg = str(e)
            check(time.time() - t0 < 8, f"the client took {time.time() - t0:.1f} s to notice")
            check("request 41" in msg and "request 42" in msg and c.lost(), f"the error does not name them: {msg}")
            srv2 = Server(env.dir, "lost2", port=port)
            try:
                check(c.resubmit() == 2, "resubmit did not send 2 requests")
                done = list(c.results())
                check(sorted((s.request_id, s.sample) for s in done) == [(41, 0), (41, 1), (42, 0), (42, 1)],
                      f"after resubmission: {[(s.request_id, s.sample) for s in done]}")
                check(all(len(s.token_ids) == 1000 for s in done), "resubmitted samples are not whole")
            finally:
                srv2.stop()
        finally:
            srv.stop()


# ---- aborts and deadlines --------------------------------------------------------

def until_reply(c, want, timeout_s=30):
    """Reads until the first message of type want: the tokens streamed and
    the dones that came before it ({(request, sample): done}), and it."""
    dones, end = {}, time.time() + timeout_s
    c.ntok = getattr(c, "ntok", {})
    while time.time() < end:
        m = c.recv(500)
        if m is None:
            continue
        key = (m.get("request_id"), m.get("sample"))
        if m["type"] == "tokens":
            check(m["start"] == c.ntok.get(key, 0), f"tokens of {key} start at {m['start']}")
            c.ntok[key] = m["start"] + len(m["token_ids"])
        elif m["type"] == "done":
            check(key not in dones, f"a second done for {key}")
            dones[key] = m
        elif m["type"] == want:
            return dones, m
        else:
            raise Failure(f"{m['type']} while waiting for {want}: {m}")
    raise Failure(f"no {want} within {timeout_s} s")


def check_partials(c, dones, keys, k, what):
    """Each sample of keys ended once, reason abort, with what it made: its
    streamed tokens and, per token, k top log-probs."""
    check(sorted(dones) == sorted(keys), f"{what}: dones {sorted(dones)}, expected {sorted(keys)}")
    for key, d in dones.items():
        n = c.ntok.get(key, 0)
        check(d["finish_reason"] == "abort" and d["n_tokens"] == n, f"{what}: {key} ended {d['finish_reason']} "
                                                                  f"with {d['n_tokens']} tokens, {n} streamed")
        if k:
            top = d.get("top_logprobs") or {}
            check(top.get("k") == k and len(top.get("token_ids", [])) == k * n, f"{what}: {key}'s top log-probs")


def abort_partials(srv):
    """Abort of one request, pause abort, and abort of a held request: every
    sample ends once, before the reply, with the tokens and top log-probs it
    made (a held one with none)."""
    with Raw(srv.endpoint) as c:
        for r in (1, 2):
            gen(c, r, n=2, prompt=[256, r, 9], logprobs=2, **LONG)
        for _ in range(200):   # stats replies pace the reads until both requests stream
            c.send({"type": "stats"})
            until_reply(c, "stats_reply")
            if {1, 2} <= {k[0] for k, v in c.ntok.items() if v}:
                break
        check({1, 2} <= {k[0] for k, v in c.ntok.items() if v}, "no tokens of both requests")
        c.send({"type": "abort", "request_ids": [1]})
        dones, r = until_reply(c, "abort_reply")
        check(r["samples"] == 2, f"abort reply {r}")
        check_partials(c, dones, [(1, 0), (1, 1)], 2, "abort")
        c.send({"type": "pause", "mode": "abort"})
        dones, r = until_reply(c, "pause_reply")
        check(r["aborted"] == 2, f"pause reply {r}")
        check_partials(c, dones, [(2, 0), (2, 1)], 2, "pause abort")
        gen(c, 3, n=2, prompt=[256, 3, 9], **LONG)   # held by the pause
        c.send({"type": "abort", "all": True})
        dones, r = until_reply(c, "abort_reply")
        check(r["samples"] == 2, f"abort of the held request: {r}")
        check_partials(c, dones, [(3, 0), (3, 1)], 0, "abort of a held request")
        check(all(d["n_tokens"] == 0 for d in dones.values()), "a held request made tokens")
        c.send({"type": "resume"})
        until_reply(c, "resume_reply")
        check(c.stats()["server"]["open_requests"] == 0, "requests left open")


@scenario
def abort_keeps_partials(env):
    """abort, pause abort, abort of a held request: each ended sample's done
    carries what it made (docs/protocol.md, abort)."""
    abort_partials(env.srv)


@scenario
def abort_keeps_partials_mpi(env):
    """The same on two engines under mpirun -np 2: what an engine made comes
    back to rank 0 with its done (skipped without mpirun)."""
    launcher = mpirun()
    if not launcher:
        print("     SKIP: mpirun not found", flush=True)
        return
    srv = Server(env.dir, "mpiabort", launcher=launcher)
    try:
        abort_partials(srv)
    finally:
        srv.stop()


@scenario
def deadline_frozen_server(env):
    """A call of the Python client whose deadline passes while the server is
    frozen (SIGSTOP): it raises DeadlineExceeded naming its requests within
    its deadline and reply timeout; once the server runs again, nothing of
    those requests reaches a later call, which gets exactly its own
    samples."""
    sys.path.insert(0, os.path.join(ROOT, "trainer_bridge", "client", "python"))
    from fp4rollout_client import DeadlineExceeded, RolloutClient, TokenDelta
    srv = Server(env.dir, "frozen")
    probe = Raw(srv.endpoint)
    try:
        with RolloutClient(srv.endpoint, timeout_ms=1000) as c:
            stream = c.generate_stream([[256, 4, 4], [256, 5, 5]], n=2, timeout_ms=1500, **LONG)
            check(isinstance(next(stream), TokenDelta), "no tokens before the freeze")
            os.kill(srv.proc.pid, signal.SIGSTOP)
            t0 = time.time()
            try:
                for _ in stream:
                    pass
                raise Failure("the call ended without its deadline")
            except DeadlineExceeded as e:
                ids = e.request_ids
                check(ids and all(f"{r}" in str(e) for r in ids), f"the error does not name the requests: {e}")
            finally:
                os.kill(srv.proc.pid, signal.SIGCONT)
            check(time.time() - t0 < 15, f"the deadline of 1.5 s took {time.time() - t0:.1f} s")
            check(wait_for(lambda: probe.stats()["server"]["open_requests"] == 0, 30),
                  "the expired call's requests still run")
            got = list(c.generate([256, 6, 6], n=2, max_tokens=8, stop_token_ids=[]))
            check(len(got) == 2 and not ({s.request_id for s in got} & set(ids)), "the next call got old samples")
            check(list(c.results()) == [] and c.open_samples() == 0 and not c.lost(), "old samples left over")
    finally:
        probe.close()
        srv.stop()


# ---- storms and load -----------------------------------------------------------

@scenario
def malformed_storm(env):
    """2,000 malformed messages: one error each, a bystander loses nothing,
    memory and descriptors flat."""
    srv = env.srv
    rng = random.Random(5)
    by, c = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        rss0, fd0 = srv.rss_kb(), srv.fds()
        gen(by, 1, n=4, max_tokens=300, stop_token_ids=[], temperature=1.0)
        kinds = [lambda: bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
                 lambda: pack({"type": "generate", "v": 1, "request_id": 1, "prompt": "x"}),
                 lambda: pack({"type": "nope", "v": 1}),
                 lambda: pack({"type": "stats", "v": 1, "extra": 1}),
                 lambda: pack([1, 2, 3]),
                 lambda: b"\xdd\xff\xff\xff\xff",
                 lambda: raw_map((b"type", b"\xfe"), (b"v", 1))]
        n = 2000
        for i in range(n):
            c.send(kinds[i % len(kinds)]())
        errors = 0
        while errors < n:
            m = c.recv(10000)
            check(m is not None, f"{errors} errors for {n} malformed messages")
            check(m["type"] == "error", f"{m}")
            errors += 1
        check(c.recv(300) is None, "more than one reply to a malformed message")
        collect(by, [1], 4, 60)
        grew = (srv.rss_kb() - rss0) / 1024
        check(grew < 16, f"resident memory grew {grew:.0f} MiB")
        check(srv.fds() <= fd0 + 2, f"descriptors {fd0} -> {srv.fds()}")
    finally:
        by.close()
        c.close()


@scenario
def slow_reader(env):
    """A client that stops reading while its samples stream: a bystander is
    not held up, and when the slow one reads again every sample is there,
    once, in order."""
    # the default heartbeat timeout (10 s): a reader whose queue is full
    # answers no heartbeats, so a pause longer than that counts as departed
    srv = Server(env.dir, "slow", coordinator={"heartbeat_timeout_ms": 10000})
    slow, by = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        slow.sock.setsockopt(__import__("zmq").RCVHWM, 16)   # the server's queue for it fills
        for r in range(4):
            gen(slow, r, n=4, prompt=[256, r], max_tokens=200, stop_token_ids=[], temperature=1.0)
        time.sleep(0.5)
        t0 = time.time()
        gen(by, 1, n=2, max_tokens=64, stop_token_ids=[], temperature=1.0)
        collect(by, [1], 2, 30)
        check(time.time() - t0 < 10, f"the bystander took {time.time() - t0:.1f} s beside a slow reader")
        time.sleep(1.0)
        time.sleep(2.0)   # 2.5 s without reading in all
        got = collect(slow, range(4), 4, 60)
        check(all(d["n_tokens"] == 200 for d in got.values()), "the slow reader's samples are short")
    finally:
        slow.close()
        by.close()
        srv.stop()


@scenario
def clients_aborts_updates(env):
    """4 clients x 8 requests x n=3 with aborts while weight updates commit:
    every sample ends exactly once."""
    srv = env.srv
    cs = [Raw(srv.endpoint) for _ in range(4)]
    try:
        for i, c in enumerate(cs):
            for r in range(8):
                gen(c, r, n=3, prompt=[256, i, r], max_tokens=30 + 10 * r, stop_token_ids=[], temperature=1.0)
        push = subprocess.run([CLI, "--endpoint", srv.endpoint, "push-weights", "--model", "synthetic:tiny:7",
                               "--version", str(env.next_version()), "--bucket-bytes", "262144"],
                              capture_output=True, text=True, timeout=60)
        check(push.returncode == 0, f"push-weights: {push.stderr[-300:]}")
        for c in cs[:2]:
            c.send({"type": "abort", "request_ids": [6, 7]})
        for c in cs:
            got = collect(c, range(8), 3, 60)
            check(len(got) == 24, f"{len(got)} samples")
    finally:
        for c in cs:
            c.close()


for _f in faults_pause.SCENARIOS:
    scenario(_f)


class Env:
    def __init__(self):
        self.dir = tmpdir()
        self.srv = Server(self.dir)
        self.probe = Raw(self.srv.endpoint)
        self.tensors = tensor_list()
        self.version = 0

    def next_version(self):
        self.version = max(self.version, self.probe.stats()["server"]["weight_version"]) + 1
        return self.version

    def close(self):
        self.probe.close()
        self.srv.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()
    if args.list:
        print("\n".join(f.__name__ for f in SCENARIOS))
        return 0
    chosen = [f for f in SCENARIOS if not args.only or f.__name__ in args.only.split(",")]
    env = Env()
    passed = failed = 0
    fd0 = env.srv.fds()
    try:
        for f in chosen:
            t0 = time.time()
            try:
                f(env)
                passed += 1
                print(f"ok   {f.__name__} ({time.time() - t0:.1f} s)", flush=True)
            except Failure as e:
                failed += 1
                print(f"FAIL {f.__name__}: {e}", flush=True)
            except Exception as e:  # noqa: BLE001
                failed += 1
                print(f"FAIL {f.__name__}: {type(e).__name__}: {e}", flush=True)
        if env.srv.proc.poll() is not None:
            failed += 1
            print("FAIL the server exited: " + env.srv.log_text()[-600:])
        elif env.srv.fds() > fd0 + 4:
            failed += 1
            print(f"FAIL descriptors grew from {fd0} to {env.srv.fds()}")
    finally:
        env.close()
    if failed:
        print("--- server log (tail):\n" + env.srv.log_text()[-1500:])
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
