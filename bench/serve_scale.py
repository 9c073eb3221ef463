"""Several engines behind one coordinator: `fp4rollout serve` under mpirun
with E engines of tp T (started by the caller), 256 prompts x n=8 through the
Python ctypes client, the weights of another model pushed as version 2 once
the first sample is done; prints every sample accounted for, the aggregate
tokens/s, and the weight-sync time.

usage: serve_scale.py ENDPOINT WEIGHTS_BIN WEIGHTS_INDEX [PROMPTS] [N] [MAX_TOKENS]
WEIGHTS_* come from `fp4rollout-client push-weights --model SPEC --export FILE`.
"""
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import RolloutClient, load_exported  # noqa: E402


def main():
    ep, wbin, windex = sys.argv[1:4]
    n_prompts = int(sys.argv[4]) if len(sys.argv) > 4 else 256
    n = int(sys.argv[5]) if len(sys.argv) > 5 else 8
    max_tokens = int(sys.argv[6]) if len(sys.argv) > 6 else 16
    weights = load_exported(wbin, windex)
    nbytes = sum(w.nbytes for w in weights.values())
    random.seed(1)
    prompts = [[256] + [random.randint(0, 255) for _ in range(random.randint(4, 60))] for _ in range(n_prompts)]
    with RolloutClient(ep, timeout_ms=600000) as c:
        info = c.hello("serve_scale")
        t0 = time.monotonic()
        for i, p in enumerate(prompts):
            c.submit(p, n=n, temperature=1.0, seed=3, max_tokens=max_tokens, stop_token_ids=[], request_id=i,
                     group_id=i)
        got, sync = [], None
        for s in c.results():
            got.append(s)
            if sync is None:
                u0 = time.monotonic()
                c.update_weights(weights, version=2)
                sync = time.monotonic() - u0
        wall = time.monotonic() - t0
        keys = {(s.request_id, s.sample) for s in got}
        tokens = sum(len(s.token_ids) for s in got)
        v2 = sum(1 for s in got if s.weight_versions and s.weight_versions[-1] == 2)
        ok = len(got) == len(keys) == n_prompts * n
        print(f"| {info.get('engines')} | {info.get('tp')} | {n_prompts} x {n} | {len(got)} ({'all once' if ok else 'MISSING'}) "
              f"| {tokens} | {wall:.1f} | {tokens / wall:.0f} | {sync:.2f} ({nbytes} bytes) | {v2} |")
        sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
