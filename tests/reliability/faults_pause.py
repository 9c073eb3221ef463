"""Fault scenarios of pauses and continued samples (tests/reliability/README.md),
registered by faults.py; spoken by hand (harness.Raw), from docs/protocol.md
alone: "pause" (modes wait, abort, keep) and generate's continue_tokens."""
import os
import subprocess
import time

from harness import BIN, Failure, Raw, Server, check, wait_for

CLI = os.path.join(os.path.dirname(BIN), "fp4rollout-client")

LONG = {"max_tokens": 1500, "stop_token_ids": [], "temperature": 1.0}


def stream(c, keys, tokens, until=None, timeout_s=60):
    """Reads c's messages of the samples keys, (request, sample) pairs, into
    tokens[key] (checking each delta's start), until every one streamed
    (until "started") or ended; returns their dones by key."""
    dones, end, ids = {}, time.time() + timeout_s, {r for r, _ in keys}
    while time.time() < end:
        if until == "started" and all(tokens.get(k) for k in keys):
            return dones
        if until is None and len(dones) == len(keys):
            return dones
        m = c.recv(500)
        if m is None or m.get("request_id") not in ids:
            continue
        if m["type"] == "tokens":
            key = (m["request_id"], m["sample"])
            have = tokens.setdefault(key, {"start": m["start"], "ids": [], "lps": [], "wvs": []})
            check(m["start"] == have["start"] + len(have["ids"]), f"{key}: a delta starts at {m['start']}")
            have["ids"] += m["token_ids"]
            have["lps"] += m["logprobs"]
            have["wvs"] += m["weight_versions"]
        elif m["type"] == "done":
            key = (m["request_id"], m["sample"])
            check(key not in dones, f"a second done for {key}")
            dones[key] = m
        elif m["type"] == "error":
            raise Failure(f"error: {m}")
    raise Failure(f"samples {keys} did not {'start' if until else 'end'} within {timeout_s} s")


def generate(c, rid, sample, seed, cont=None):
    msg = {"type": "generate", "request_id": rid, "prompt": [256, 8, 9, 10], "n": 1 if cont is not None else 2,
           "seed": seed, **LONG}
    if cont is not None:
        msg.update(first_sample=sample, continue_tokens=cont)
    c.send(msg)


def abort_then_continue(env):
    """Samples ended by abort are continued; the continuing client dies
    mid-stream and a new client continues from what it had received: every
    sample comes out whole, bitwise the uninterrupted one (deterministic
    server), each part's deltas and done starting where the part before
    ended."""
    srv = Server(env.dir, "continue", deterministic=True)
    a, b = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        toks = {}
        generate(a, 1, 0, 5)
        stream(a, [(1, 0), (1, 1)], toks, until="started")
        a.send({"type": "abort", "request_ids": [1]})
        dones = stream(a, [(1, 0), (1, 1)], toks)
        made = {k: toks[(1, k)]["ids"] for k in range(2)}
        lps = {k: toks[(1, k)]["lps"] for k in range(2)}
        check(all(d["finish_reason"] == "abort" for d in dones.values()), "the abort ended nothing")
        for k in range(2):   # continued by a, which dies after the first tokens
            generate(a, 10 + k, k, 5, made[k])
            stream(a, [(10 + k, k)], toks, until="started")
            check(toks[(10 + k, k)]["start"] == len(made[k]), f"sample {k}'s continuation starts elsewhere")
        time.sleep(0.2)
        a.close()
        check(wait_for(lambda: b.stats()["server"]["open_requests"] == 0, 5), "the dead client's samples still run")
        for k in range(2):   # b has what a received: it continues from there
            t = toks[(10 + k, k)]
            made[k] += t["ids"]
            lps[k] += t["lps"]
            generate(b, 20 + k, k, 5, made[k])
            d = stream(b, [(20 + k, k)], toks)[(20 + k, k)]
            check(d["start"] == len(made[k]) and d["finish_reason"] == "length", f"sample {k}'s last part: {d}")
            made[k] += toks[(20 + k, k)]["ids"]
            lps[k] += toks[(20 + k, k)]["lps"]
            generate(b, 30 + k, k, 5, [])   # the sample uninterrupted (an empty continue_tokens: from its start)
            stream(b, [(30 + k, k)], toks)
            check(made[k] == toks[(30 + k, k)]["ids"] and lps[k] == toks[(30 + k, k)]["lps"],
                  f"sample {k} continued twice differs from it uninterrupted")
    finally:
        b.close()
        srv.stop()


def keep_across_update(env):
    """pause keep with a client departing while frozen (its samples end,
    their KV pages return) and a weight update committed while frozen: the
    other client's samples then finish, their versions switching where they
    stopped; nothing was drawn during the pause."""
    srv, probe = env.srv, env.probe
    a, b = Raw(srv.endpoint), Raw(srv.endpoint)
    try:
        ta, tb = {}, {}
        a.send({"type": "generate", "request_id": 1, "prompt": [256, 1, 1], "n": 2, **LONG})
        b.send({"type": "generate", "request_id": 1, "prompt": [256, 2, 2], "n": 2, **LONG})
        stream(a, [(1, 0), (1, 1)], ta, until="started")
        stream(b, [(1, 0), (1, 1)], tb, until="started")
        r = probe.call({"type": "pause", "mode": "keep"}, "pause_reply")
        check(r["type"] == "pause_reply" and r["mode"] == "keep", f"pause reply {r}")
        s0 = probe.stats()
        a.close()
        check(wait_for(lambda: probe.stats()["server"]["open_requests"] == 1, 5), "the departed client's samples "
                                                                                   "did not end while frozen")
        old, version = s0["server"]["weight_version"], env.next_version()
        push = subprocess.run([CLI, "--endpoint", srv.endpoint, "push-weights", "--model", "synthetic:tiny:7",
                               "--version", str(version), "--bucket-bytes", "262144"],
                              capture_output=True, text=True, timeout=60)
        check(push.returncode == 0, f"push-weights while frozen: {push.stderr[-300:]}")
        s1 = probe.stats()
        check(s1["scheduler"]["tokens_generated"] == s0["scheduler"]["tokens_generated"] and
              s1["scheduler"]["running"] == 2, f"the engine moved while frozen: {s0['scheduler']} {s1['scheduler']}")
        r = probe.call({"type": "resume"}, "resume_reply")
        check(r["type"] == "resume_reply", f"resume reply {r}")
        for key, d in stream(b, [(1, 0), (1, 1)], tb).items():
            v = tb[key]["wvs"]
            k = v.index(version) if version in v else len(v)
            check(d["finish_reason"] == "length" and 1 <= k < len(v) and v == [old] * k + [version] * (len(v) - k),
                  f"{key} ended {d['finish_reason']}, versions {v[:2]}...{v[-2:]} do not switch to {version}")
        check(wait_for(lambda: probe.stats()["scheduler"]["kv_blocks_used"] == 0, 5), "KV pages left in use")
    finally:
        a.close()
        b.close()


SCENARIOS = [abort_then_continue, keep_across_update]
