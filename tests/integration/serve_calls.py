"""The calls an RL trainer makes, the way it makes them (many at once, aborts
of over-sampled groups, pauses around weight updates, deadlines), through
the Python client against a running `fp4rollout serve` (synthetic:tiny,
deterministic mode, f32 KV); started by serve_calls.sh.

usage: serve_calls.py ENDPOINT
"""
import asyncio
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import (AsyncRolloutClient, DeadlineExceeded, RolloutClient, SampleResult,  # noqa: E402
                               ServerError, TokenDelta)

EP = sys.argv[1]
GREEDY = dict(temperature=0.0, max_tokens=12, stop_token_ids=[])
# Samples that run until something ends them (well inside the window).
LONG = dict(temperature=1.0, max_tokens=3000, stop_token_ids=[], logprobs=2)


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_calls: {what}")


def prompt(i):
    return [256, 40 + i % 50, 7 + i % 13, i % 256]


def key(s):
    return (s.token_ids, s.logprobs)


def check_partial(s, what):
    """An aborted sample with what it made: tokens, log-probs, weight
    versions and the asked-for top log-probs, one per token."""
    check(s.finish_reason == "abort", f"{what}: finish_reason {s.finish_reason}, expected abort")
    n = len(s.token_ids)
    check(n >= 1, f"{what}: an aborted sample came without the tokens it made")
    check(len(s.logprobs) == len(s.weight_versions) == n, f"{what}: {n} tokens, {len(s.logprobs)} log-probs, "
                                                        f"{len(s.weight_versions)} versions")
    check(all(lp <= 0 for lp in s.logprobs), f"{what}: a log-prob above 0")
    check(s.top_logprobs is not None and len(s.top_logprobs) == n, f"{what}: top log-probs missing")


def once(samples, ids, n, what):
    """Every sample of the requests ids, indices 0..n-1, exactly once, and
    nothing else."""
    seen = sorted((s.request_id, s.sample) for s in samples)
    want = sorted((r, k) for r in ids for k in range(n))
    check(seen == want, f"{what}: samples {seen[:8]}..., expected {want[:8]}... ({len(seen)} vs {len(want)})")


# ---- many calls at once ----------------------------------------------------------

async def concurrent_calls():
    """64 generate calls at once on one asyncio client, n from 1 to 4: each
    gets exactly its own samples, each once, equal (deterministic mode,
    greedy) to the same prompt run alone."""
    async with AsyncRolloutClient(EP) as c:
        ns = [1 + i % 4 for i in range(64)]
        got = await asyncio.gather(*[c.generate(prompt(i), n=n, **GREEDY) for i, n in enumerate(ns)])
        for i, (n, samples) in enumerate(zip(ns, got)):
            ids = {s.request_id for s in samples}
            check(len(ids) == 1, f"call {i} got samples of requests {sorted(ids)}")
            once(samples, ids, n, f"call {i}")
        for i in range(64):
            alone = await c.generate(prompt(i), n=1, **GREEDY)
            check(key(alone[0]) == key(got[i][0]), f"call {i}'s sample differs from the prompt run alone")
        # a second wave while the first calls' results are long consumed
        got = await asyncio.gather(*[c.generate(prompt(i), n=2, **GREEDY) for i in range(16)])
        for i, samples in enumerate(got):
            check(len(samples) == 2 and len({s.request_id for s in samples}) == 1, f"wave 2 call {i}")
            check(key(samples[0]) == key(samples[1]), f"wave 2 call {i}: two greedy samples differ")


def threads_on_one_client():
    """Eight threads, one blocking client: each generate() yields exactly
    its own samples, equal to the prompt run alone."""
    out, errors = {}, []
    with RolloutClient(EP) as c:
        def run(t):
            try:
                for k in range(3):
                    out[(t, k)] = list(c.generate(prompt(8 * t + k), n=2, **GREEDY))
            except Exception as e:   # reported by the main thread
                errors.append(f"thread {t}: {e!r}")
        ths = [threading.Thread(target=run, args=(t,)) for t in range(8)]
        for th in ths:
            th.start()
        for th in ths:
            th.join()
        check(not errors, "; ".join(errors))
        for (t, k), samples in out.items():
            ids = {s.request_id for s in samples}
            check(len(ids) == 1, f"thread {t} call {k} got samples of requests {sorted(ids)}")
            once(samples, ids, 2, f"thread {t} call {k}")
            alone = list(c.generate(prompt(8 * t + k), n=1, **GREEDY))
            check(key(alone[0]) == key(samples[0]), f"thread {t} call {k} differs from the prompt run alone")
        check(c.open_samples() == 0 and c.stats()["server"]["open_requests"] == 0, "requests left open")


# ---- aborts and pauses keep what was made ----------------------------------------------

async def first_delta(stream):
    async for e in stream:
        check(isinstance(e, TokenDelta), f"a sample ended before its first delta: {e}")
        return e


async def running(c, i, n):
    """A call whose request the server has (its first token came): its id,
    and a task that yields its samples."""
    stream = c.stream_tokens(prompt(i), n=n, **LONG)
    rid = (await first_delta(stream)).request_id

    async def rest():
        return [e async for e in stream if isinstance(e, SampleResult)]
    return rid, asyncio.ensure_future(rest())


async def until(cond, what):
    for _ in range(300):
        if await cond():
            return
        await asyncio.sleep(0.05)
    check(False, what)


async def aborts():
    """abort of some requests, abort of all, pause("abort"): every sample they
    end comes out once, of the call that waits for it, with what it made;
    a request sent during the pause is held and runs at resume."""
    async with AsyncRolloutClient(EP) as c:
        calls = [await running(c, i, 2) for i in range(4)]
        victim, task = calls.pop()
        reply = await c.abort([victim])
        check(reply["samples"] == 2 and reply["not_found"] == [], f"abort reply {reply}")
        ended = await task
        once(ended, [victim], 2, "the aborted call")
        for s in ended:
            check_partial(s, "abort of one request")
        reply = await c.abort()
        check(reply["samples"] == 6, f"abort of all ended {reply['samples']} samples, expected 6")
        for rid, task in calls:
            samples = await task
            once(samples, [rid], 2, "a call hit by abort of all")
            for s in samples:
                check_partial(s, "abort of all")
        calls = [await running(c, i, 2) for i in range(2)] + [await running(c, 11, 1)]
        reply = await c.pause("abort")
        check(reply["mode"] == "abort" and reply["aborted"] == 5, f"pause reply {reply}")
        for (rid, task), n in zip(calls, (2, 2, 1)):
            samples = await task
            once(samples, [rid], n, "a call hit by pause abort")
            for s in samples:
                check_partial(s, "pause abort")
        held = asyncio.ensure_future(c.generate(prompt(12), n=2, **GREEDY))

        async def is_held():
            return (await c.stats())["server"]["held_requests"] == 1
        await until(is_held, "no request held by the pause")
        check(not held.done(), "a held request ran during the pause")
        await c.resume()
        samples = await held
        check(all(s.finish_reason == "length" and len(s.token_ids) == 12 for s in samples), "the held request")
        check((await c.stats())["server"]["open_requests"] == 0, "requests left open")


def sync_aborts():
    """The blocking client: submit() then abort(): results() yields the ended
    samples once, with what they made."""
    with RolloutClient(EP) as c:
        rid = c.submit(prompt(1), n=3, **LONG)
        first = next(iter(c.events()))
        check(isinstance(first, TokenDelta) and first.request_id == rid, "no delta of the request")
        check(c.abort([rid])["samples"] == 3, "the abort did not end 3 samples")
        check(c.open_samples() == 3, f"{c.open_samples()} samples open after the abort, expected 3 (not read yet)")
        samples = list(c.results())
        once(samples, [rid], 3, "results() after abort")
        for s in samples:
            check_partial(s, "sync abort")
        check(list(c.results()) == [] and c.open_samples() == 0, "results() again yields more")


# ---- deadlines --------------------------------------------------------------------------

def deadlines():
    """A call whose deadline passes: its requests are aborted on the server,
    it raises naming them with what they made, and nothing of them reaches
    a later call."""
    with RolloutClient(EP) as c:
        t0 = time.monotonic()
        try:
            list(c.generate([prompt(3), prompt(4)], n=2, timeout_ms=400, **LONG))
            check(False, "a 3000-token call finished within 400 ms")
        except DeadlineExceeded as e:
            check(time.monotonic() - t0 < 30, "the deadline took far longer than its 400 ms")
            check(len(e.request_ids) == 2 and all(str(r) in str(e) for r in e.request_ids),
                  f"the error does not name the requests: {e}")
            once(e.samples, e.request_ids, 2, "the samples of the expired call")
            for s in e.samples:
                check_partial(s, "deadline")
            old = set(e.request_ids)
        check(c.stats()["server"]["open_requests"] == 0, "the expired call's requests still run on the server")
        samples = list(c.generate(prompt(5), n=2, **GREEDY))
        check(len(samples) == 2 and not ({s.request_id for s in samples} & old), "the next call got old samples")
        check(list(c.results()) == [] and c.open_samples() == 0, "something of the expired call is left")
        # results() with a deadline, over submitted requests
        rid = c.submit(prompt(6), n=1, **LONG)
        try:
            list(c.results(timeout_ms=300))
            check(False, "results() outlived its deadline")
        except DeadlineExceeded as e:
            check(e.request_ids == [rid] and len(e.samples) == 1, f"results() deadline: {e}")
        check(list(c.results()) == [], "the expired request reached a later results()")


async def async_deadline():
    async with AsyncRolloutClient(EP) as c:
        try:
            await c.generate(prompt(7), n=3, timeout_ms=400, **LONG)
            check(False, "an async 3000-token call finished within 400 ms")
        except DeadlineExceeded as e:
            once(e.samples, e.request_ids, 3, "the async expired call")
            old = set(e.request_ids)
        # a cancelled call's requests end too
        task = asyncio.ensure_future(c.generate(prompt(8), n=2, **LONG))
        await asyncio.sleep(0.3)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

        async def none_open():
            return (await c.stats())["server"]["open_requests"] == 0
        await until(none_open, "a cancelled call's requests still run")
        samples = await c.generate(prompt(9), n=2, **GREEDY)
        check(len(samples) == 2 and not ({s.request_id for s in samples} & old), "the next async call got old samples")


# ---- long samples with the default time limits -------------------------------------------

def long_sample():
    """A sample as long as synthetic:tiny's window allows, through clients
    whose reply timeout is far shorter than the sample: waits for samples
    have no limit by default, and a pause in mode wait lasts as long as the
    samples in flight."""
    with RolloutClient(EP) as c:
        window = c.hello()["max_model_len"]
    p = prompt(10)
    with RolloutClient(EP, timeout_ms=100) as c:
        (s,) = list(c.generate(p, n=1, temperature=1.0, max_tokens=window - len(p), stop_token_ids=[]))
        check(s.finish_reason == "length" and len(s.token_ids) == window - len(p),
              f"{s.finish_reason} after {len(s.token_ids)} tokens, expected length after {window - len(p)}")
    with RolloutClient(EP, timeout_ms=100) as c, RolloutClient(EP) as other:
        rid = other.submit(p, n=1, temperature=1.0, max_tokens=window - len(p), stop_token_ids=[])
        next(iter(other.events()))
        check(c.pause("wait")["mode"] == "wait", "pause wait")
        (s,) = list(other.results())
        check(s.request_id == rid and s.finish_reason == "length", "the sample a pause waited for")
        other.resume()

    async def run():
        async with AsyncRolloutClient(EP, timeout_ms=100) as a:
            (s,) = await a.generate(p, n=1, temperature=1.0, max_tokens=window - len(p), stop_token_ids=[])
            check(s.finish_reason == "length" and len(s.token_ids) == window - len(p), "the async long sample")
    asyncio.run(run())


# ---- bad input -----------------------------------------------------------------------------

def bad_input():
    """Stop ids outside the vocabulary and max_tokens beyond the window are
    refused with invalid_request naming the request; nothing is left open."""
    with RolloutClient(EP) as c:
        h = c.hello()
        vocab, window = h["vocab_size"], h["max_model_len"]
        for stops in ([vocab], [1 << 40], [-1]):
            try:
                list(c.generate(prompt(0), n=2, max_tokens=4, stop_token_ids=stops))
                check(False, f"stop ids {stops} were accepted")
            except ServerError as e:
                check(e.code == "invalid_request" and e.request_id is not None and f"request {e.request_id}" in str(e),
                      f"stop ids {stops}: {e}")
        p = prompt(0)
        try:
            list(c.generate(p, max_tokens=window - len(p) + 1))
            check(False, "max_tokens beyond the window was accepted")
        except ServerError as e:
            check(e.code == "invalid_request" and str(window - len(p)) in e.message, f"max_tokens: {e}")
        (s,) = list(c.generate(p, max_tokens=3, stop_token_ids=[]))
        check(s.finish_reason == "length" and len(s.token_ids) == 3, "a good request after the refusals")
        check(c.open_samples() == 0 and c.stats()["server"]["open_requests"] == 0, "refused requests left open")


def main():
    t0 = time.monotonic()
    asyncio.run(concurrent_calls())
    threads_on_one_client()
    asyncio.run(aborts())
    sync_aborts()
    deadlines()
    asyncio.run(async_deadline())
    long_sample()
    bad_input()
    print(f"serve_calls.py: all checks passed in {time.monotonic() - t0:.1f} s")


main()
