"""Seeds through the Python client against running `fp4rollout serve`s;
started by serve_seeds.sh.

usage: serve_seeds.py OS_ENDPOINT SEEDED_ENDPOINT_A SEEDED_ENDPOINT_B CONFIG_SEED DET_ENDPOINT
OS_ENDPOINT serves without a configured seed; the two others are separate
servers started with the same `sampling.seed` CONFIG_SEED; DET_ENDPOINT
serves in deterministic mode with a BF16 KV cache.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import RolloutClient  # noqa: E402

PROMPT = [256, 104, 101, 108, 108, 111]
M64 = (1 << 64) - 1


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_seeds: {what}")


def splitmix64(state):
    """The server's stream (base/seed.c), written from its definition: the
    seeds after `state`, forever."""
    while True:
        state = (state + 0x9E3779B97F4A7C15) & M64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
        yield z ^ (z >> 31)


def run_alone(c, n=2, **kw):
    """One request alone in the server's batch: its samples by index."""
    c.submit(PROMPT, n=n, temperature=1.0, max_tokens=24, stop_token_ids=[], **kw)
    got = sorted(c.results(), key=lambda s: s.sample)
    check(len(got) == n, f"{len(got)} samples, expected {n}")
    return got


def deterministic_replays(ep):
    """Deterministic mode (BF16 KV): samples drawn in a busy batch (three
    unseeded requests of three samples at once, two prompts) replay bitwise
    one at a time, alone, from their reported seed and index."""
    other = [256, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]
    with RolloutClient(ep, timeout_ms=20000) as c:
        ids = [c.submit(p, n=3, temperature=1.0, max_tokens=24, stop_token_ids=[]) for p in (PROMPT, other, PROMPT)]
        busy = {(s.request_id, s.sample): s for s in c.results()}
        check(len(busy) == 9, f"{len(busy)} samples, expected 9")
        check(len({busy[(r, 0)].seed for r in ids}) == 3, "three unseeded requests did not get three seeds")
        check(not same(busy[(ids[0], 0)], busy[(ids[2], 0)]), "two unseeded requests for one prompt are equal")
        for r, prompt in zip(ids, (PROMPT, other, PROMPT)):
            for k in range(3):
                want = busy[(r, k)]
                c.submit(prompt, n=1, temperature=1.0, max_tokens=24, stop_token_ids=[], seed=want.seed,
                         first_sample=k)
                (got,) = list(c.results())
                check(got.sample == k and got.seed == want.seed, f"the replay reports sample {got.sample}, seed {got.seed}")
                check(same(got, want), f"request {r} sample {k} (seed {want.seed}) did not replay bitwise alone")


def same(a, b):
    # bitwise: the float32 log-probs compare exactly as Python floats
    return a.token_ids == b.token_ids and a.logprobs == b.logprobs


def main():
    os_ep, ep_a, ep_b, config_seed, det_ep = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    deterministic_replays(det_ep)

    with RolloutClient(os_ep, timeout_ms=20000) as c:
        # The same prompt twice without a seed: fresh seeds, different samples.
        first, second = run_alone(c), run_alone(c)
        for got in (first, second):
            check(all(s.seed is not None for s in got), "a done without its seed")
            check(got[0].seed == got[1].seed, f"samples of one request report seeds {got[0].seed}, {got[1].seed}")
            check(not same(got[0], got[1]), "samples 0 and 1 of one request are equal")
        check(first[0].seed != second[0].seed, f"two unseeded requests both got seed {first[0].seed}")
        check(not same(first[0], second[0]) and not same(first[1], second[1]),
              "two unseeded requests for the same prompt gave the same samples")
        # Replayed with its reported seed (alone in the batch again): bitwise the same.
        replay = run_alone(c, seed=first[0].seed)
        check(all(r.seed == first[0].seed for r in replay), "the replay reports another seed")
        for k in range(2):
            check(same(first[k], replay[k]), f"sample {k} replayed with seed {first[0].seed} differs")
        # Both at once: each still its own (the seed, not the batch, picks the tokens).
        a = c.submit(PROMPT, n=2, temperature=1.0, max_tokens=24, stop_token_ids=[])
        b = c.submit(PROMPT, n=2, temperature=1.0, max_tokens=24, stop_token_ids=[])
        both = {(s.request_id, s.sample): s for s in c.results()}
        check(both[(a, 0)].seed != both[(b, 0)].seed, "two concurrent unseeded requests share a seed")
        check(not same(both[(a, 0)], both[(b, 0)]), "two concurrent unseeded requests gave the same sample")
        oseed = first[0].seed

    # A configured seed: two servers give the same seeds and samples, in
    # request order, and the seeds are the stream's.
    runs = []
    for ep in (ep_a, ep_b):
        with RolloutClient(ep, timeout_ms=20000) as c:
            runs.append([run_alone(c) for _ in range(3)])
    stream = splitmix64(config_seed)
    for i in range(3):
        want = next(stream)
        for r in runs:
            check(r[i][0].seed == want, f"request {i}: seed {r[i][0].seed}, the configured stream's is {want}")
        for k in range(2):
            check(same(runs[0][i][k], runs[1][i][k]), f"request {i} sample {k} differs between the seeded servers")
    check(runs[0][0][0].seed != runs[0][1][0].seed, "the configured stream repeated a seed")
    print(oseed)


if __name__ == "__main__":
    main()
