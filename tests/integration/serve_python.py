"""The Python ctypes client (trainer_bridge/client/python/fp4rollout_client) against a running `fp4rollout
serve`; started by serve_bridge.sh.

usage: serve_python.py ENDPOINT PROMPTS REFERENCE_JSONL
REFERENCE_JSONL is `fp4rollout rollout --json` on PROMPTS with --n 4
--max-tokens 40 --temperature 1 --seed 11 (the same engine settings).
"""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import RolloutClient, ServerError  # noqa: E402


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_python: {what}")


def main():
    endpoint, prompts_path, ref_path = sys.argv[1:4]
    prompts = [[int(t) for t in line.split(",")] for line in open(prompts_path) if line.strip()]
    ref = {}
    for line in open(ref_path):
        r = json.loads(line)
        ref[(r["request_id"], r["sample"])] = r

    with RolloutClient(endpoint, timeout_ms=20000) as c:
        info = c.hello("serve_python")
        check(info["model"] == "synthetic:tiny" and info["vocab_size"] == 272 and info["weight_version"] == 0,
              f"hello: {info}")

        # The same rollout as the reference, through the Python client
        # (request ids 0, 1, ... as the reference numbers them).
        for i, p in enumerate(prompts):
            c.submit(p, n=4, temperature=1.0, seed=11, max_tokens=40, request_id=i)
        got = {(t.request_id, t.sample): t for t in c.results()}
        check(set(got) == set(ref), f"samples {sorted(set(ref) ^ set(got))[:5]} missing or extra")
        for k, t in got.items():
            r = ref[k]
            check(t.token_ids == r["token_ids"], f"sample {k}: tokens differ from fp4rollout rollout")
            check(t.finish_reason == r["finish_reason"], f"sample {k}: finish reason {t.finish_reason}")
            check(all(abs(a - b) <= 1e-5 * max(1, abs(b)) for a, b in zip(t.logprobs, r["logprobs"])),
                  f"sample {k}: log-probs differ")
            check(t.weight_versions == [0] * len(t.token_ids), f"sample {k}: weight versions")
            check(t.group_id == k[0] and t.divergence["kl_mean"] is None, f"sample {k}: group or divergence")
            check(t.ttft_ms is not None and t.total_ms >= t.ttft_ms >= 0, f"sample {k}: timings")

        # Abort one of two long requests once the first sample of the other
        # ends... both run 600 tokens, so abort as soon as results start.
        c.submit(prompts[0], n=2, max_tokens=600, stop_token_ids=[], temperature=1.0, seed=5, request_id=100)
        c.submit(prompts[1], n=2, max_tokens=600, stop_token_ids=[], temperature=1.0, seed=5, request_id=101)
        reply = c.abort([101, 555])
        check(reply["samples"] == 2 and reply["not_found"] == [555], f"abort reply {reply}")
        done = {(t.request_id, t.sample): t for t in c.results()}
        check(len(done) == 4, f"abort: {len(done)} samples ended")
        for s in range(2):
            check(done[(101, s)].finish_reason == "abort" and len(done[(101, s)].token_ids) < 600,
                  f"aborted sample {s}: {done[(101, s)].finish_reason}")
            check(done[(100, s)].finish_reason == "length" and len(done[(100, s)].token_ids) == 600,
                  f"untouched sample {s}: {done[(100, s)].finish_reason}")

        # Pause (nothing in flight: at once), a held request, resume.
        check(c.pause("wait")["state"] == "paused", "pause")
        c.submit(prompts[2], n=1, max_tokens=8, temperature=0, request_id=200)
        st = c.stats()
        check(st["server"]["state"] == "paused" and st["server"]["held_requests"] == 1, f"stats while paused: {st}")
        check(c.resume()["released"] == 1, "resume released")
        held = list(c.results())
        check(len(held) == 1 and held[0].finish_reason in ("stop", "length"), "held request")

        # An invalid request is refused with its id.
        c.submit([256, 999], n=1, request_id=300)
        try:
            list(c.results())
            check(False, "a token outside the vocabulary was accepted")
        except ServerError as e:
            check(e.request_id == 300 and e.code == "invalid_request" and "vocabulary" in e.message, str(e))
        st = c.stats()
        check(st["scheduler"]["running"] == 0 and st["server"]["open_requests"] == 0, f"final stats {st}")
        check(math.isfinite(st["scheduler"]["steps"]), "stats")
    print("serve_python: all checks passed")


if __name__ == "__main__":
    main()
