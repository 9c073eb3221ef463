"""Routed experts through the Python client (docs/deepseek_moe.md,
"Routed-expert replay") against a running `fp4rollout serve` on
synthetic:tiny-dsmoe; started by serve_routes.sh.

usage: serve_routes.py ENDPOINT ROLLOUT_JSONL
SampleResult.routed_experts of a greedy sample has shape (n_tokens, layers,
k) and equals what `fp4rollout rollout --return-routed-experts --json`
printed for the same prompt (ROLLOUT_JSONL, request 0); a continuation of
the sample's first tokens carries the experts of its own tokens, and
stitch() joins them into the whole sample's; a request that does not ask
gets none.
"""
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import RolloutClient, stitch  # noqa: E402

PROMPT = [1, 2, 3, 4, 5]
GREEDY = dict(temperature=0.0, max_tokens=8, stop_token_ids=[])


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_routes: {what}")


def as_lists(routes):
    """numpy's array or the nested lists, as nested lists."""
    return routes.tolist() if hasattr(routes, "tolist") else routes


def main():
    ep, rollout = sys.argv[1], sys.argv[2]
    engine = [x for x in map(json.loads, open(rollout)) if x["request_id"] == 0][0]
    with RolloutClient(ep, timeout_ms=20000) as c:
        whole = list(c.generate(PROMPT, return_routed_experts=True, **GREEDY))[0]
        check(whole.token_ids == engine["token_ids"], f"tokens {whole.token_ids} != the engine's {engine['token_ids']}")
        routes = as_lists(whole.routed_experts)
        check(routes == engine["routed_experts"], f"experts {routes} != the engine's {engine['routed_experts']}")
        if hasattr(whole.routed_experts, "shape"):
            check(whole.routed_experts.shape == (8, len(routes[0]), len(routes[0][0])), "shape (n_tokens, layers, k)")
        plain = list(c.generate(PROMPT, **GREEDY))[0]
        check(plain.routed_experts is None and plain.token_ids == whole.token_ids, "experts sent unasked")

        # A continuation: the first 3 tokens as a partial sample, the rest
        # made again; its experts are its own tokens', and stitched they are
        # the whole sample's.
        part = dataclasses.replace(whole, token_ids=whole.token_ids[:3], logprobs=whole.logprobs[:3],
                                   weight_versions=whole.weight_versions[:3], finish_reason="abort",
                                   routed_experts=whole.routed_experts[:3])
        rest = list(c.generate(PROMPT, continue_tokens=part.token_ids, seed=whole.seed, return_routed_experts=True,
                               **GREEDY))[0]
        check(rest.start == 3 and rest.token_ids == whole.token_ids[3:], f"continuation {rest.start} {rest.token_ids}")
        check(as_lists(rest.routed_experts) == routes[3:], "a continuation's experts are not its own tokens'")
        check(as_lists(stitch(part, rest).routed_experts) == routes, "stitch() does not join the experts")
        again = c.continue_sample(PROMPT, part, return_routed_experts=True, **GREEDY)
        check(again.token_ids == whole.token_ids and as_lists(again.routed_experts) == routes,
              "continue_sample() does not keep the experts")
    print("serve_routes.py: ok")


if __name__ == "__main__":
    main()
