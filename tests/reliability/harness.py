"""Shared pieces of the fault and load harness (tests/reliability/README.md):
a `fp4rollout serve` process on loopback, raw protocol clients written
from docs/protocol.md alone (pyzmq DEALER sockets and msgpack, no project
code), and the server's resident memory and open descriptors from /proc."""
import json
import os
import signal
import socket
import subprocess
import tempfile
import time

import msgpack
import zmq

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("BUILD", "build")
BIN = os.path.join(BUILD if os.path.isabs(BUILD) else os.path.join(ROOT, BUILD), "fp4rollout")
CTX = zmq.Context.instance()


class Failure(Exception):
    pass


def check(cond, what):
    if not cond:
        raise Failure(what)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Server:
    """One `fp4rollout serve` on synthetic:tiny (CPU, f32 KV) with the given
    configuration keys over the defaults below; its log in self.log_path."""

    def __init__(self, workdir, name="serve", launcher=(), port=None, **conf):
        self.port = port or free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        c = {"model": "synthetic:tiny", "backend": "cpu", "kv_dtype": "f32", "max_seqs": 16,
             "coordinator": {"bind": "127.0.0.1", "port": self.port, "heartbeat_ms": 200,
                             "heartbeat_timeout_ms": 1000}}
        if os.environ.get("FR_RELIABILITY_PLAIN_CONFIG"):   # for a binary older than these keys
            for k in ("heartbeat_ms", "heartbeat_timeout_ms"):
                del c["coordinator"][k]
        for k, v in conf.items():
            if isinstance(v, dict) and isinstance(c.get(k), dict):
                c[k].update(v)
            else:
                c[k] = v
        self.config = c
        self.conf_path = os.path.join(workdir, name + ".json")
        self.log_path = os.path.join(workdir, name + ".log")
        json.dump(c, open(self.conf_path, "w"))
        env = dict(os.environ, OPENBLAS_NUM_THREADS="1")
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(list(launcher) + [BIN, "serve", "--config", self.conf_path], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=bool(launcher))
        deadline = time.time() + 60
        while time.time() < deadline:
            if "listening on" in self.log_text():
                return
            if self.proc.poll() is not None:
                raise Failure(f"{name} exited at start: {self.log_text()[-800:]}")
            time.sleep(0.05)
        raise Failure(f"{name} did not start")

    def log_text(self):
        try:
            return open(self.log_path, "rb").read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    def pid(self):
        return self.proc.pid

    def rss_kb(self, pid=None):
        for line in open(f"/proc/{pid or self.proc.pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return -1

    def fds(self, pid=None):
        return len(os.listdir(f"/proc/{pid or self.proc.pid}/fd"))

    def stop(self):
        if self.proc.poll() is None:
            if self.proc.args[0] == BIN:
                self.proc.send_signal(signal.SIGTERM)
            else:   # a launcher (mpirun): its whole group
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def pack(msg):
    return msgpack.packb(msg, use_bin_type=True)


def idle_connections(port, n):
    """n TCP connections to a loopback port that send nothing (non-blocking
    connects: the caller closes them)."""
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex(("127.0.0.1", port))
        socks.append(s)
    return socks


class Raw:
    """A DEALER speaking the protocol by hand."""

    def __init__(self, endpoint, routing_id=None, curve=None, heartbeat=False):
        self.sock = CTX.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if routing_id is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, routing_id)
        if curve:
            server_pub, pub, sec = curve
            self.sock.curve_serverkey = server_pub.encode()
            self.sock.curve_publickey = pub.encode()
            self.sock.curve_secretkey = sec.encode()
        if heartbeat:
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, 200)
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 1000)
        self.sock.connect(endpoint)

    def send(self, msg, *frames):
        data = msg if isinstance(msg, bytes) else pack(dict({"v": 1}, **msg))
        self.sock.send_multipart([data] + list(frames))

    def recv(self, timeout_ms=10000, raw=False):
        """The next message decoded strictly (str must be UTF-8), or None."""
        if not self.sock.poll(timeout_ms):
            return None
        frames = self.sock.recv_multipart()
        if raw:
            return frames[0]
        return msgpack.unpackb(frames[0], raw=False)

    def call(self, msg, want, timeout_ms=10000):
        """Sends msg and returns the first reply of type want or error,
        keeping what else arrives in self.other."""
        self.send(msg)
        self.other = getattr(self, "other", [])
        end = time.time() + timeout_ms / 1000
        while time.time() < end:
            m = self.recv(int(max(1, (end - time.time()) * 1000)))
            if m is None:
                break
            if m["type"] in (want, "error"):
                return m
            self.other.append(m)
        raise Failure(f"no {want} within {timeout_ms} ms")

    def stats(self):
        return self.call({"type": "stats"}, "stats_reply")

    def close(self):
        self.sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for(pred, timeout_s, step=0.05):
    end = time.time() + timeout_s
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    return pred()


def collect(client, request_ids, n, timeout_s=60):
    """Reads until every (request, sample) of request_ids x range(n) has its
    done; returns {(request, sample): done}, checking that tokens and dones
    agree and no done comes twice."""
    want = {(r, k) for r in request_ids for k in range(n)}
    got, ntok = {}, {}
    end = time.time() + timeout_s
    while want - set(got) and time.time() < end:
        m = client.recv(int(max(1, (end - time.time()) * 1000)))
        if m is None:
            break
        key = (m.get("request_id"), m.get("sample"))
        if m["type"] == "tokens":
            check(m["start"] == ntok.get(key, 0), f"tokens of {key} start at {m['start']}, expected {ntok.get(key, 0)}")
            ntok[key] = m["start"] + len(m["token_ids"])
        elif m["type"] == "done":
            check(key not in got, f"a second done for {key}")
            check(m["n_tokens"] == ntok.get(key, 0), f"{key}: done says {m['n_tokens']} tokens, {ntok.get(key, 0)} came")
            got[key] = m
        elif m["type"] == "error":
            raise Failure(f"error while collecting: {m}")
    check(not (want - set(got)), f"{len(want - set(got))} samples never ended, e.g. {sorted(want - set(got))[:3]}")
    return got


def tmpdir():
    return tempfile.mkdtemp(prefix="fr-reliability-")
