"""pause("keep") on a server of several ranks (started by serve_mpi.sh): four
requests spread over the engines draw their first tokens, every rank freezes
(nothing is drawn while the pause lasts), a weight update commits on every
rank while frozen, and at resume every sample switches weight versions where
it stopped; with recompute (at the pause or at the resume) each one's tokens
from the switch on equal a continuation on the new weights, bitwise
(deterministic mode).

usage: serve_pause_ranks.py ENDPOINT WEIGHTS.bin WEIGHTS.jsonl VERSION pause|resume
"""
import asyncio
import os
import sys

sys.path.insert(0, os.path.join(os.getcwd(), "trainer_bridge", "client", "python"))
from fp4rollout_client import AsyncRolloutClient, SampleResult, TokenDelta, load_exported  # noqa: E402

EP, WBIN, WINDEX, VERSION, WHEN = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
OPTS = dict(temperature=1.0, max_tokens=1500, stop_token_ids=[])


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_pause_ranks: {what}")


def prompt(i):
    return [256, 9 + i, 30 + 2 * i, 5]


async def first_token(c, i):
    stream = c.stream_tokens(prompt(i), n=1, **OPTS)
    async for e in stream:
        check(isinstance(e, TokenDelta), "a sample ended before its first token")
        break

    async def rest():
        return [e async for e in stream if isinstance(e, SampleResult)][0]
    return asyncio.ensure_future(rest())


async def main():
    weights = load_exported(WBIN, WINDEX)
    async with AsyncRolloutClient(EP, timeout_ms=60000) as c:
        old = (await c.stats())["server"]["weight_version"]
        tasks = [await first_token(c, i) for i in range(4)]
        reply = await c.pause("keep", recompute=WHEN == "pause")
        check(reply["mode"] == "keep", f"pause reply {reply}")
        a = await c.stats()
        await asyncio.sleep(0.5)
        commit = await c.update_weights(weights, version=VERSION, bucket_bytes=256 << 10)
        check(commit["weight_version"] == VERSION, f"commit {commit}")
        await asyncio.sleep(0.5)
        b = await c.stats()
        check(b["server"]["state"] == "paused" and a["scheduler"]["tokens_generated"] ==
              b["scheduler"]["tokens_generated"] and a["scheduler"]["steps"] == b["scheduler"]["steps"],
              f"an engine stepped while frozen: {a['scheduler']} then {b['scheduler']}")
        await c.resume(recompute=WHEN == "resume")
        samples = [await t for t in tasks]
        for i, s in enumerate(samples):
            v = s.weight_versions
            k = v.index(VERSION) if VERSION in v else len(v)
            check(s.finish_reason == "length" and 1 <= k < len(v) and v == [old] * k + [VERSION] * (len(v) - k),
                  f"request {i}: versions {v[:3]}...{v[-3:]} do not switch from {old} to {VERSION}")
            part = SampleResult(**{**s.__dict__, "token_ids": s.token_ids[:k], "logprobs": s.logprobs[:k],
                                   "weight_versions": v[:k], "finish_reason": "abort"})
            whole = await c.continue_sample(prompt(i), part, **OPTS)
            check(whole.token_ids == s.token_ids and whole.logprobs == s.logprobs,
                  f"request {i}: its tokens after the switch differ from a continuation on the new weights")
    print(f"serve_pause_ranks: 4 samples frozen across version {old} -> {VERSION} (recompute at {WHEN})")


asyncio.run(main())
