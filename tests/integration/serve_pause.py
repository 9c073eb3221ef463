"""Pause modes and continued samples through the Python client (asyncio and
blocking) against a running `fp4rollout serve` (synthetic:tiny, deterministic
mode, f32 KV, max_seqs 4); started by serve_pause.sh.

- pause("wait"): the samples running finish, queued and new requests are
  held (no token drawn) until resume, then run as they would have;
- pause("keep"): nothing is drawn while frozen; a weight update committed
  meanwhile draws every token after the resume (each sample's versions
  switch mid-sample); without recompute the samples go on over the old KV
  cache (their next log-probs differ from a recomputed continuation's);
  with recompute, at resume or at the pause (its KV pages freed at once),
  their tokens after the switch equal a continuation on the new weights
  from the same point, bitwise;
- the transitions between modes (keep while a wait pause waits cancels it,
  wait while frozen answers at once);
- a sample ended by abort() or pause("abort") and continued
  (continue_sample) is bitwise the sample never interrupted: tokens,
  log-probs, top log-probs, with the right `start`; bad continuations are
  refused.

usage: serve_pause.py ENDPOINT W7.bin W7.jsonl W0.bin W0.jsonl
(synthetic:tiny:7's and synthetic:tiny's tensors, from fp4rollout-client
push-weights --export)
"""
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import (AsyncRolloutClient, RolloutClient, SampleResult, ServerError,  # noqa: E402
                               TokenDelta, load_exported, stitch)

EP = sys.argv[1]
W7 = load_exported(sys.argv[2], sys.argv[3])
W0 = load_exported(sys.argv[4], sys.argv[5])
# Samples that run until something stops them (well inside the window of 4096).
LONG = dict(temperature=1.0, max_tokens=2500, stop_token_ids=[])
GREEDY = dict(temperature=0.0, max_tokens=16, stop_token_ids=[])


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_pause: {what}")


def prompt(i):
    return [256, 40 + i % 50, 7 + i % 13, i % 256, 3]


async def until(cond, what):
    for _ in range(600):
        if await cond():
            return
        await asyncio.sleep(0.05)
    check(False, what)


async def started(c, i, n, **opts):
    """A call whose samples have all drawn a token: its request id and a
    task yielding its samples."""
    stream = c.stream_tokens(prompt(i), n=n, **{**LONG, **opts})
    seen, rid = set(), None
    async for e in stream:
        check(isinstance(e, TokenDelta), f"a sample ended before the others started: {e}")
        rid = e.request_id
        seen.add(e.sample)
        if len(seen) == n:
            break

    async def rest():
        return [e async for e in stream if isinstance(e, SampleResult)]
    return rid, asyncio.ensure_future(rest())


# ---- wait ---------------------------------------------------------------------------------

async def pause_wait():
    """Running samples finish; a request queued in the engine (no slot) and
    one sent during the pause draw nothing until resume, then give what
    they give alone."""
    async with AsyncRolloutClient(EP) as c:
        _, running = await started(c, 0, 3, max_tokens=1500)
        queued = asyncio.ensure_future(c.generate(prompt(1), n=2, **GREEDY))   # 3 + 2 > max_seqs 4: it waits

        async def in_engine():
            return (await c.stats())["scheduler"]["waiting"] == 2
        await until(in_engine, "the second request is not queued in the engine")
        reply = await c.pause("wait")
        check(reply["mode"] == "wait" and reply["aborted"] == 0, f"pause reply {reply}")
        ran = await running
        check(len(ran) == 3 and all(s.finish_reason == "length" and len(s.token_ids) == 1500 for s in ran),
              "the running samples did not finish whole before the wait pause's reply")
        late = asyncio.ensure_future(c.generate(prompt(2), n=1, **GREEDY))

        async def late_held():
            return (await c.stats())["server"]["held_requests"] == 1
        await until(late_held, "a request sent during the pause is not held")
        a = await c.stats()
        await asyncio.sleep(0.5)
        b = await c.stats()
        check(a["server"]["state"] == "paused" and b["scheduler"]["waiting"] == 2, f"stats while paused {b}")
        check(a["scheduler"]["tokens_generated"] == b["scheduler"]["tokens_generated"] and
              b["scheduler"]["running"] == 0, "the engine drew tokens during a wait pause")
        check(not queued.done() and not late.done(), "a held request ran during the pause")
        await c.resume()
        for task, i, n in ((queued, 1, 2), (late, 2, 1)):
            got = await task
            alone = await c.generate(prompt(i), n=n, **GREEDY)
            check(sorted((s.sample, s.token_ids) for s in got) == sorted((s.sample, s.token_ids) for s in alone),
                  f"held request {i} differs from its run alone")


# ---- keep -----------------------------------------------------------------------------------

async def frozen_stats(c):
    """Nothing is drawn while frozen: the figures of two stats a while apart."""
    a = await c.stats()
    await asyncio.sleep(0.5)
    b = await c.stats()
    check(b["server"]["state"] == "paused", f"state {b['server']['state']}")
    check(a["scheduler"]["tokens_generated"] == b["scheduler"]["tokens_generated"] and
          a["scheduler"]["steps"] == b["scheduler"]["steps"], "the engine stepped while frozen")
    return b


def switched(s, old, new):
    """The index of s's first token on the new weights: versions old then new."""
    v = s.weight_versions
    k = v.index(new) if new in v else len(v)
    check(k >= 1 and k < len(v) and v == [old] * k + [new] * (len(v) - k),
          f"sample {s.request_id}/{s.sample}: versions {v[:4]}...{v[-4:]} do not switch from {old} to {new}")
    return k


async def keep(c, weights, old, new, recompute):
    """Three samples frozen mid-sample by pause("keep") (recompute None,
    "pause" or "resume"), an update to `new` committed while frozen, then
    resume: every sample switches versions where it was frozen. Returns the
    samples and the first new-version index of each."""
    rid, task = await started(c, 20 + new, 3)
    reply = await c.pause("keep", recompute=recompute == "pause")
    check(reply["mode"] == "keep" and reply["aborted"] == 0, f"pause keep reply {reply}")
    st = await frozen_stats(c)
    check(st["scheduler"]["running"] == (0 if recompute == "pause" else 3), f"running while frozen: {st['scheduler']}")
    if recompute == "pause":   # the KV pages are free for the update
        check(st["scheduler"]["kv_blocks_used"] == 0, f"KV pages kept: {st['scheduler']}")
    held = asyncio.ensure_future(c.generate(prompt(3), n=1, **GREEDY))

    async def is_held():
        return (await c.stats())["server"]["held_requests"] == 1
    await until(is_held, "a request sent while frozen is not held")
    commit = await c.update_weights(weights, version=new, bucket_bytes=256 << 10)
    check(commit["weight_version"] == new, f"commit {commit}")
    await frozen_stats(c)   # the commit took no step either
    await c.resume(recompute=recompute == "resume")
    samples = await task
    check(len(samples) == 3 and all(s.finish_reason == "length" and len(s.token_ids) == 2500 for s in samples),
          "frozen samples did not finish whole")
    (h,) = await held
    check(set(h.weight_versions) == {new}, f"the held request drew with versions {set(h.weight_versions)}")
    return samples, [switched(s, old, new) for s in samples]


async def same_as_continuation(c, samples, ks, i, exact):
    """Each sample from its switch on against a continuation of its first k
    tokens on the weights now serving: equal bitwise (exact), or with other
    log-probs at the switch (the old weights' KV cache kept)."""
    for s, k in zip(samples, ks):
        part = SampleResult(**{**s.__dict__, "token_ids": s.token_ids[:k], "logprobs": s.logprobs[:k],
                               "weight_versions": s.weight_versions[:k], "finish_reason": "abort"})
        whole = await c.continue_sample(prompt(i), part, **LONG)
        if exact:
            check(whole.token_ids == s.token_ids and whole.logprobs == s.logprobs,
                  f"sample {s.sample}: resumed with recompute, it is not the continuation on the new weights")
        else:
            check(whole.logprobs[k] != s.logprobs[k],
                  f"sample {s.sample}: without recompute its next log-prob equals a recomputed one's")


async def pause_keep():
    async with AsyncRolloutClient(EP) as c:
        v = (await c.stats())["server"]["weight_version"]
        samples, ks = await keep(c, W7, v, v + 1, None)
        await same_as_continuation(c, samples, ks, 20 + v + 1, exact=False)
        samples, ks = await keep(c, W0, v + 1, v + 2, "resume")
        await same_as_continuation(c, samples, ks, 20 + v + 2, exact=True)
        samples, ks = await keep(c, W7, v + 2, v + 3, "pause")
        await same_as_continuation(c, samples, ks, 20 + v + 3, exact=True)
        await c.update_weights(W0, version=v + 4, bucket_bytes=256 << 10)   # back to synthetic:tiny


async def transitions():
    """keep while a wait pause waits: the waiter gets pause_cancelled; wait
    while frozen: answered at once, the samples stay frozen; abort while
    frozen: the frozen samples end with what they made."""
    async with AsyncRolloutClient(EP) as c:
        rid, task = await started(c, 30, 2)
        waiter = asyncio.ensure_future(c.pause("wait"))

        async def pausing():
            return (await c.stats())["server"]["state"] == "pausing"
        await until(pausing, "the wait pause is not pausing")
        check((await c.pause("keep"))["mode"] == "keep", "pause keep")
        try:
            await waiter
            check(False, "the wait pause was answered though keep froze its samples")
        except ServerError as e:
            check(e.code == "pause_cancelled", f"the waiter got {e.code}: {e.message}")
        check((await c.pause("wait"))["mode"] == "wait", "pause wait while frozen")
        await frozen_stats(c)
        reply = await c.pause("abort")
        check(reply["aborted"] == 2, f"pause abort while frozen ended {reply['aborted']} samples")
        for s in await task:
            check(s.finish_reason == "abort" and 1 <= len(s.token_ids) < 2500, "a frozen sample ended by abort")
        await c.resume()
        check((await c.stats())["server"]["state"] == "running", "not running after resume")


# ---- continuing partial samples ----------------------------------------------------------------

async def continue_partials():
    """Samples ended by abort() and by pause("abort"), continued: each whole
    sample bitwise the uninterrupted one (seeded, so the same sample)."""
    async with AsyncRolloutClient(EP) as c:
        for how in ("abort", "pause"):
            opts = {**LONG, "seed": 99, "logprobs": 2}
            rid, task = await started(c, 40, 2, **opts)
            if how == "abort":
                await c.abort([rid])
            else:
                await c.pause("abort")
                await c.resume()
            parts = await task
            alone = {s.sample: s for s in await c.generate(prompt(40), n=2, **opts)}
            for p in parts:
                check(p.finish_reason == "abort" and 1 <= len(p.token_ids) < 2500, f"{how}: partial {p}")
                whole = await c.continue_sample(prompt(40), p, **opts)
                want = alone[p.sample]
                check(whole.token_ids == want.token_ids and whole.logprobs == want.logprobs and
                      whole.top_logprobs == want.top_logprobs and whole.finish_reason == "length",
                      f"{how}: sample {p.sample} continued from token {len(p.token_ids)} differs from it uninterrupted")
                check(whole.start == 0 and whole.seed == 99 and whole.group_id == p.group_id, f"{how}: {whole}")


def continue_blocking():
    """The blocking client: a continuation as a raw request (its result
    starts at the continued count, its deltas count from there), a
    continuation of a continuation, and the refusals."""
    with RolloutClient(EP) as c:
        opts = dict(temperature=1.0, max_tokens=300, stop_token_ids=[], seed=5)
        (want,) = list(c.generate(prompt(50), n=1, first_sample=7, **opts))
        k1, k2 = 40, 170
        deltas, rest = [], None
        for e in c.generate_stream(prompt(50), n=1, first_sample=7, continue_tokens=want.token_ids[:k1], **opts):
            if isinstance(e, TokenDelta):
                deltas.append(e)
            else:
                rest = e
        check(deltas and deltas[0].start == k1 and rest.start == k1, f"deltas from {deltas[0].start}, start {rest.start}")
        check(rest.token_ids == want.token_ids[k1:] and rest.logprobs == want.logprobs[k1:], "the raw continuation")
        first = SampleResult(**{**want.__dict__, "token_ids": want.token_ids[:k1], "logprobs": want.logprobs[:k1],
                                "weight_versions": want.weight_versions[:k1], "finish_reason": "abort"})
        mid = SampleResult(**{**rest.__dict__, "token_ids": rest.token_ids[:k2 - k1],
                              "logprobs": rest.logprobs[:k2 - k1], "weight_versions": rest.weight_versions[:k2 - k1],
                              "finish_reason": "abort"})
        whole = c.continue_sample(prompt(50), stitch(first, mid), **opts)
        check(whole.token_ids == want.token_ids and whole.logprobs == want.logprobs, "a continued continuation")
        for bad, what in ((dict(n=2, continue_tokens=[1, 2]), "n 2"),
                          (dict(continue_tokens=list(range(300))), "nothing left to generate"),
                          (dict(continue_tokens=[1, 272]), "outside the vocabulary")):
            try:
                list(c.generate(prompt(50), **{**opts, **bad}))
                check(False, f"a continuation with {what} was accepted")
            except ServerError as e:
                check(e.code == "invalid_request" and e.request_id is not None, f"{what}: {e}")
        check(c.stats()["server"]["open_requests"] == 0, "requests left open")


def main():
    t0 = time.monotonic()
    asyncio.run(pause_wait())
    asyncio.run(pause_keep())
    asyncio.run(transitions())
    asyncio.run(continue_partials())
    continue_blocking()
    print(f"serve_pause.py: all checks passed in {time.monotonic() - t0:.1f} s")


main()
