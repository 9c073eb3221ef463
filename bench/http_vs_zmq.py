#!/usr/bin/env python3
"""Tokens/s of N concurrent /generate calls over HTTP against the same load
through the ZeroMQ Python client, on one running `fp4rollout serve` (same
prompts, sampling and batch limits: the server's). docs/http.md.

    fp4rollout serve --model M --port 5555 --http-port 8000 &
    bench/http_vs_zmq.py --http http://127.0.0.1:8000 --zmq tcp://127.0.0.1:5555 --n 1024 --max-tokens 256

Each side runs twice (the first warms the engine) and the second is timed;
prints one JSON line per side and the ratio. Beside tokens/s each line has
the CPU seconds per token of this client (client_cpu_us_per_token) and,
with --server-pid, of the server process (server_cpu_us_per_token), which
say which side would bound the rate where the engine is faster."""
import argparse
import asyncio
import json
import os
import random
import sys
import time

import aiohttp


def prompts(n, length, vocab, seed):
    r = random.Random(seed)
    return [[r.randrange(vocab) for _ in range(length)] for _ in range(n)]


async def http_run(url, ps, a):
    sp = {"max_new_tokens": a.max_tokens, "temperature": a.temperature, "ignore_eos": True}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as s:
        async def one(i, p):
            async with s.post(url + "/generate", json={"input_ids": p, "sampling_params": dict(sp, seed=i)}) as r:
                return len((await r.json())["output_ids"])
        t0 = time.monotonic()
        n = sum(await asyncio.gather(*[one(i, p) for i, p in enumerate(ps)]))
        return n, time.monotonic() - t0


def zmq_run(ep, ps, a):
    from fp4rollout_client import RolloutClient
    with RolloutClient(ep) as c:
        t0 = time.monotonic()
        out = list(c.generate(ps, max_tokens=a.max_tokens, temperature=a.temperature, stop_token_ids=[]))
        return sum(len(s.token_ids) for s in out), time.monotonic() - t0


def server_cpu_s(pid):
    """User + system CPU seconds of process pid so far (Linux /proc), or None."""
    if not pid:
        return None
    with open("/proc/%d/stat" % pid) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--http", required=True)
    ap.add_argument("--zmq", required=True)
    ap.add_argument("--n", type=int, default=1024, help="concurrent requests")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--vocab", type=int, default=256, help="prompt ids are drawn below this")
    ap.add_argument("--server-pid", type=int, default=0, help="the server's pid, for its CPU time per token")
    a = ap.parse_args()
    ps = prompts(a.n, a.prompt_len, a.vocab, 1)
    res = {}
    for side in ("zmq", "http"):
        for rep in range(2):
            c0, s0 = time.process_time(), server_cpu_s(a.server_pid)
            n, secs = zmq_run(a.zmq, ps, a) if side == "zmq" else asyncio.run(http_run(a.http, ps, a))
            c1, s1 = time.process_time(), server_cpu_s(a.server_pid)
        res[side] = n / secs
        line = {"side": side, "requests": a.n, "tokens": n, "seconds": round(secs, 3),
                "tokens_per_s": round(n / secs, 1), "client_cpu_us_per_token": round(1e6 * (c1 - c0) / n, 1)}
        if s0 is not None:
            line["server_cpu_us_per_token"] = round(1e6 * (s1 - s0) / n, 1)
        print(json.dumps(line))
    print(json.dumps({"http_over_zmq": round(res["http"] / res["zmq"], 3)}))


if __name__ == "__main__":
    sys.exit(main())
