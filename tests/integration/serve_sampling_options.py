"""The sampling options trainers ask for (docs/sampling.md) through the Python
client against a running `fp4rollout serve` (f32 KV, synthetic:tiny); started
by serve_sampling_options.sh.

usage: serve_sampling_options.py ENDPOINT OUT_JSON
Writes the samples of one request with every option to OUT_JSON, for the
script to compare with `fp4rollout rollout`. Also checks token-level
streaming (RolloutClient.generate_stream, AsyncRolloutClient.stream_tokens):
a sample's deltas arrive before it ends, in order, and concatenated equal
its result.
"""
import asyncio
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import (AsyncRolloutClient, ClientError, RolloutClient, SampleResult,  # noqa: E402
                               ServerError, TokenDelta)

PROMPT = [256, 104, 101, 108, 108, 111, 32, 119]


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_sampling_options: {what}")


def check_stream(events, n_samples):
    """Deltas then the sample, tokens in order; returns the samples."""
    got, done = {}, {}
    for e in events:
        key = (e.request_id, e.sample)
        if isinstance(e, TokenDelta):
            check(key not in done, f"a delta of {key} after its end")
            toks, lps = got.setdefault(key, ([], []))
            check(e.start == len(toks) and len(e.token_ids) == len(e.logprobs) == len(e.weight_versions) >= 1,
                  f"delta of {key} starts at {e.start} after {len(toks)} tokens")
            toks += e.token_ids
            lps += e.logprobs
        else:
            check(isinstance(e, SampleResult) and key not in done, f"a second end of {key}")
            done[key] = e
            check(got.get(key, ([], []))[0] == e.token_ids and got[key][1] == e.logprobs,
                  f"the deltas of {key} differ from its result")
    check(len(done) == n_samples, f"{len(done)} samples ended, expected {n_samples}")
    return got


def streaming(ep):
    with RolloutClient(ep, timeout_ms=20000) as c:
        got = check_stream(c.generate_stream([PROMPT, PROMPT[:3]], n=2, temperature=1.0, max_tokens=12,
                                             stop_token_ids=[]), 4)
        check(all(len(v[0]) == 12 for v in got.values()), "streamed samples are not whole")

    async def run():
        async with AsyncRolloutClient(ep, timeout_ms=20000) as a:
            return [e async for e in a.stream_tokens(PROMPT, n=2, temperature=1.0, max_tokens=10,
                                                     stop_token_ids=[])]
    events = asyncio.run(run())
    check_stream(events, 2)
    check(sum(isinstance(e, TokenDelta) for e in events) >= 4, "the tokens did not come in several deltas")


def main():
    ep, out = sys.argv[1], sys.argv[2]
    streaming(ep)
    with RolloutClient(ep, timeout_ms=20000) as c:
        # Top log-probs change no draw: the same seed with and without them.
        plain = sorted(c.generate(PROMPT, n=2, temperature=1.0, max_tokens=16, stop_token_ids=[], seed=11),
                       key=lambda s: s.sample)
        top = sorted(c.generate(PROMPT, n=2, temperature=1.0, max_tokens=16, stop_token_ids=[], seed=11, logprobs=4),
                     key=lambda s: s.sample)
        for p, t in zip(plain, top):
            check(p.top_logprobs is None and p.prompt_logprobs is None, "options reported unasked")
            check((p.token_ids, p.logprobs) == (t.token_ids, t.logprobs), "logprobs=4 changed the samples")
            check(len(t.top_logprobs) == len(t.token_ids), "one top list per token")
            for tok, lp, pairs in zip(t.token_ids, t.logprobs, t.top_logprobs):
                check(len(pairs) == 4, f"{len(pairs)} pairs, asked for 4")
                check(all(pairs[k][1] >= pairs[k + 1][1] for k in range(3)), "top log-probs not best first")
                check(lp <= pairs[0][1], "the sampled token above the best one")
                for tid, tlp in pairs:
                    if tid == tok:
                        check(tlp == lp, "the sampled token's top log-prob differs from its log-prob")
        # Prompt log-probs: the first sample only, None for the first token.
        got = sorted(c.generate(PROMPT, n=3, temperature=0.8, max_tokens=8, stop_token_ids=[], seed=5,
                                prompt_logprobs=True, logprobs=2, min_tokens=3), key=lambda s: s.sample)
        check(got[0].prompt_logprobs is not None and len(got[0].prompt_logprobs) == len(PROMPT),
              "the first sample lacks its prompt log-probs")
        check(got[0].prompt_logprobs[0] is None and all(x < 0 for x in got[0].prompt_logprobs[1:]),
              f"prompt log-probs {got[0].prompt_logprobs}")
        check(all(s.prompt_logprobs is None for s in got[1:]), "prompt log-probs beyond the first sample")
        # min_tokens: the greedy first token as the only stop id ends a sample
        # at once, unless barred for 3 tokens.
        (g,) = c.generate(PROMPT, temperature=0.0, max_tokens=10, stop_token_ids=[])
        (a,) = c.generate(PROMPT, temperature=0.0, max_tokens=10, stop_token_ids=[g.token_ids[0]])
        check(a.finish_reason == "stop" and len(a.token_ids) == 1, "the stop id did not stop")
        (b,) = c.generate(PROMPT, temperature=0.0, max_tokens=10, stop_token_ids=[g.token_ids[0]], min_tokens=3)
        check(len(b.token_ids) >= 3 and g.token_ids[0] not in b.token_ids[:3], f"min_tokens 3 gave {b.token_ids}")
        # Bad values: refused by the client's checks, or by the server with its reason.
        for kw, needle in ((dict(logprobs=21), '"logprobs" must be in [0, 20]'),
                           (dict(min_tokens=9, max_tokens=8), '"min_tokens" (9) must not exceed "max_tokens" (8)')):
            try:
                c.submit(PROMPT, **kw)
                check(False, f"{kw} accepted")
            except ClientError as e:
                check(needle in str(e), f"{kw}: {e}")
        try:   # no max_tokens given: the server's default (16) applies
            list(c.generate(PROMPT, min_tokens=17))
            check(False, "min_tokens above the server's max_tokens accepted")
        except ServerError as e:
            check(e.code == "invalid_request" and "min_tokens must be in [0, max_tokens = 16] (got 17)" in e.message,
                  f"{e}")
    with open(out, "w") as f:
        json.dump([{"sample": s.sample, "token_ids": s.token_ids, "logprobs": s.logprobs,
                    "top_logprobs": s.top_logprobs, "prompt_logprobs": s.prompt_logprobs} for s in got], f)


if __name__ == "__main__":
    main()
