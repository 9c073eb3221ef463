"""Weight updates, divergence fields and CURVE through the Python ctypes client
(trainer_bridge/client/python/fp4rollout_client) against real `fp4rollout serve`
processes; started by serve_weights.sh.

usage: serve_weights.py MAIN_EP FRESH7_EP CURVE_EP CURVE_KEYS_JSON WEIGHTS_BIN WEIGHTS_INDEX CURVE_PUB_EP
MAIN_EP serves synthetic:tiny, FRESH7_EP a fresh synthetic:tiny:7, both f32 KV;
WEIGHTS_* are synthetic:tiny:7's tensors (fp4rollout-client push-weights --export).
"""
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
import numpy as np  # noqa: E402
from fp4rollout_client import (ClientError, MetricsSubscriber, RolloutClient, ServerError, group_by_prompt,  # noqa: E402
                               load_exported, mismatch_metrics)


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_weights: {what}")


def greedy(c, prompts):
    out = {}
    for s in c.generate(prompts, n=1, temperature=0, max_tokens=16, stop_token_ids=[]):
        out[s.request_id] = s.token_ids
    return [out[k] for k in sorted(out)]


def main():
    main_ep, fresh_ep, curve_ep, keys_path, wbin, windex, curve_pub_ep = sys.argv[1:8]
    keys = json.load(open(keys_path))
    weights = load_exported(wbin, windex)
    flat_bytes = sum(w.nbytes for w in weights.values())

    random.seed(3)
    prompts = [[256] + [random.randint(0, 255) for _ in range(random.randint(2, 30))] for _ in range(32)]
    probe = prompts[:4]

    with RolloutClient(fresh_ep, timeout_ms=60000) as fresh:
        want7 = greedy(fresh, probe)

    with RolloutClient(main_ep, timeout_ms=60000) as c:
        info = c.hello("serve_weights")
        check(info["weight_version"] == 0, f"hello: {info}")
        before = greedy(c, probe)
        check(before != want7, "synthetic:tiny and synthetic:tiny:7 give the same greedy tokens")

        # 32 prompts x 4 samples; the weights change to synthetic:tiny:7's
        # (version 2) once the first sample is done, while the rest stream.
        for i, p in enumerate(prompts):
            c.submit(p, n=4, temperature=1.0, seed=21, max_tokens=48, stop_token_ids=[], request_id=1000 + i,
                     group_id=i)
        got, commit = [], None
        for s in c.results():
            got.append(s)
            if commit is None:
                t0 = time.monotonic()
                commit = c.update_weights(weights, version=2, bucket_bytes=256 << 10)
                dt = time.monotonic() - t0
        check(commit["weight_version"] == 2 and commit["bytes"] == flat_bytes, f"commit reply {commit}")
        keys_seen = [(s.request_id, s.sample) for s in got]
        check(len(keys_seen) == 128 and len(set(keys_seen)) == 128, f"{len(keys_seen)} dones, want 128 distinct")
        v2 = 0
        for s in got:
            check(len(s.token_ids) == 48 and s.finish_reason == "length", f"sample {s.request_id}/{s.sample}")
            check(len(s.weight_versions) == len(s.token_ids), "one version per token")
            check(s.weight_versions == sorted(s.weight_versions) and set(s.weight_versions) <= {0, 2},
                  f"versions {s.weight_versions}")
            v2 += s.weight_versions[-1] == 2
        check(v2 > 0, "no token was drawn after the commit with version 2")
        groups = group_by_prompt(got)
        check(len(groups) == 32 and all(len(g) == 4 for g in groups.values()), "groups")
        check([s.sample for s in groups[5]] == [0, 1, 2, 3], "group order")
        after = greedy(c, probe)
        check(after == want7, "greedy outputs after the update differ from a fresh synthetic:tiny:7 server")
        st = c.stats()
        check(st["server"]["weight_version"] == 2 and st["server"]["updates_committed"] == 1, f"stats {st}")
        print(f"serve_weights: mid-stream update of {flat_bytes} bytes committed in {dt * 1e3:.1f} ms; "
              f"{v2} of 128 samples ended on version 2")

        # Each broken update is refused with its code; version 2 keeps serving.
        name = "model.layers.0.self_attn.q_proj.weight"
        bad_nan = dict(weights)
        bad_nan[name] = weights[name].copy()
        bad_nan[name][3, 5] = np.nan
        missing = {k: v for k, v in weights.items() if k != "model.norm.weight"}
        reshaped = dict(weights)
        reshaped[name] = weights[name].reshape(-1)
        cases = [("bad_checksum", weights, {"_corrupt_bucket": 1}), ("non_finite", bad_nan, {}),
                 ("missing_tensor", missing, {}), ("bad_shape", reshaped, {})]
        for code, tensors, extra in cases:
            try:
                c.update_weights(tensors, version=3, bucket_bytes=256 << 10, **extra)
                check(False, f"{code}: the update was accepted")
            except ServerError as e:
                check(e.code == code, f"wanted {code}, got {e.code}: {e.message}")
            st = c.stats()["server"]
            check(st["weight_version"] == 2 and not st["updating"], f"{code}: stats {st}")
            check(greedy(c, probe) == want7, f"{code}: greedy outputs changed after a refused update")
        try:
            c.update_weights(weights, version=2)
            check(False, "an update to the version serving was accepted")
        except ServerError as e:
            check(e.code == "bad_version", e.code)

        # A partial update (the Python client's partial=True): the tensors
        # sent change, the others are carried over. Sending one of
        # synthetic:tiny:7's tensors again changes nothing; the same tensor
        # with its rows reversed changes the log-probs, and sending the
        # original back restores them. Log-probs are compared within 1e-4:
        # outside deterministic mode the batch a sample shares may move them
        # by float32 roundings.
        def greedy_lp(c):
            out = {}
            for s in c.generate(probe, n=1, temperature=0, max_tokens=16, stop_token_ids=[], monitor=False):
                out[s.request_id] = (s.token_ids, s.logprobs)
            return [out[k] for k in sorted(out)]

        def lp_distance(a, b):
            if [t for t, _ in a] != [t for t, _ in b]:
                return float("inf")
            return max(abs(x - y) for (_, la), (_, lb) in zip(a, b) for x, y in zip(la, lb))
        base = greedy_lp(c)
        down = "model.layers.0.mlp.down_proj.weight"
        c.update_weights({down: weights[down]}, version=3, partial=True)
        d = lp_distance(greedy_lp(c), base)
        check(c.stats()["server"]["weight_version"] == 3 and d < 1e-4,
              f"a partial update of unchanged values changed the outputs (log-prob distance {d})")
        c.update_weights({down: np.ascontiguousarray(weights[down][::-1])}, version=4, partial=True)
        d = lp_distance(greedy_lp(c), base)
        check(d > 1e-2, f"a partial update of one tensor changed nothing (log-prob distance {d})")
        c.update_weights({down: weights[down]}, version=5, partial=True)
        d = lp_distance(greedy_lp(c), base)
        check(d < 1e-4 and greedy(c, probe) == want7,
              f"the tensor sent back did not restore the outputs (log-prob distance {d})")
        print("serve_weights: partial updates carry the tensors not sent over")

        # Divergence: monitored samples carry their figures (per token when
        # asked), unmonitored ones carry none; teacher forcing emits the
        # given tokens.
        mon = list(c.generate(probe[:2], n=2, temperature=1.0, seed=4, max_tokens=12, stop_token_ids=[],
                              monitor=True, per_token_kl=True))
        for s in mon:
            d = s.divergence
            # KL over BF16's top-128 tokens can dip a hair below 0 (truncation)
            check(d["positions"] == len(s.token_ids) and abs(d["kl_mean"]) < 1 and d["kl_max"] >= d["kl_mean"] and
                  0 <= d["top1_agreement"] <= 1 and len(d["per_token_kl"]) == len(s.token_ids), f"divergence {d}")
        off_ = list(c.generate(probe[0], n=1, max_tokens=4, monitor=False))
        check(off_[0].divergence["kl_mean"] is None, "an unmonitored sample has divergence figures")
        forced = [7, 8, 9, 10, 11]
        f = list(c.generate(probe[0], n=1, max_tokens=20, forced_tokens=forced, stop_token_ids=[]))
        check(f[0].token_ids == forced and f[0].finish_reason == "length", f"teacher forcing: {f[0].token_ids}")

        # Trainer-side mismatch metrics against exact recomputation: zero;
        # against a shifted copy: the formulas of the helper.
        lp = [s.logprobs for s in got[:8]]
        m0 = mismatch_metrics(lp, lp)
        check(m0["rollout_probs_diff_max"] == 0 and m0["mismatch_kl"] == 0, f"{m0}")
        m1 = mismatch_metrics([[-1.0, -2.0]], [[-1.1, -2.0]])
        import math
        d = abs(math.exp(-1.0) - math.exp(-1.1))
        check(abs(m1["rollout_probs_diff_mean"] - d / 2) < 1e-12 and abs(m1["rollout_probs_diff_max"] - d) < 1e-12,
              f"{m1}")
        check(abs(m1["mismatch_kl"] - (math.exp(-0.1) - 1 + 0.1) / 2) < 1e-12, f"{m1}")

    # CURVE: no keys and an unlisted key get no reply; the listed key works.
    for kw in ({}, {"server_public_key": keys["server_public"], "public_key": keys["other_public"],
                    "secret_key": keys["other_secret"]}):
        with RolloutClient(curve_ep, timeout_ms=1500, **kw) as c:
            try:
                c.hello()
                check(False, f"a client {'with an unlisted key' if kw else 'without keys'} got a reply")
            except ClientError:
                pass
    with RolloutClient(curve_ep, timeout_ms=20000, server_public_key=keys["server_public"],
                       public_key=keys["client_public"], secret_key=keys["client_secret"]) as c:
        check(c.hello()["model"] == "synthetic:tiny", "the authorized client")
        s = list(c.generate(probe[0], n=2, max_tokens=5))
        check(len(s) == 2, "the authorized client's generate")
    # the CURVE server's metrics PUB socket: the same keys decide
    for kw in ({}, {"server_public_key": keys["server_public"], "public_key": keys["other_public"],
                    "secret_key": keys["other_secret"]}):
        with MetricsSubscriber(curve_pub_ep, **kw) as sub:
            check(sub.next(1500) is None, f"a subscriber {'with an unlisted key' if kw else 'without keys'} got a snapshot")
    with MetricsSubscriber(curve_pub_ep, server_public_key=keys["server_public"], public_key=keys["client_public"],
                           secret_key=keys["client_secret"]) as sub:
        snap = sub.next(10000)
        check(snap is not None and snap["model"] == "synthetic:tiny" and snap["samples_finished_total"] == 2,
              f"the authorized subscriber's snapshot: {snap}")
    print("serve_weights: all checks passed")


if __name__ == "__main__":
    main()
