"""Weights over NCCL with tq6 (tests/gpu/weight_sync_nccl.sh starts the
servers and says what is checked). The trainer is this process, PyTorch on
its first visible GPU; the server under test serves tq6 on another GPU.

usage: weight_sync_nccl.py check MAIN_EP FRESH_EP PERTURBED_DIR [GROUP_SIZE]
       weight_sync_nccl.py die MAIN_EP       (joins a group, announces a bucket, exits without sending it)
GROUP_SIZE: the members the weight group must have, the trainer and every
rank of the server (default 2: one rank; weight_sync_nccl_tp.sh: 3).
"""
import os
import sys
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "..", "trainer_bridge", "client", "python"))
sys.path.insert(0, os.path.join(here, "..", "integration"))
from fp4rollout_client import RolloutClient, ServerError  # noqa: E402

FAILED = []


def check(cond, what):
    print(("PASS: " if cond else "FAIL: ") + what, flush=True)
    if not cond:
        FAILED.append(what)


def greedy(c, prompts):
    out = {}
    for s in c.generate([list(p) for p in prompts], n=1, temperature=0, max_tokens=24, stop_token_ids=[]):
        out[s.request_id] = list(s.token_ids)
    return [out[k] for k in sorted(out)]


def probes():
    import random
    r = random.Random(11)
    return [[256] + [r.randrange(256) for _ in range(20 + 13 * i)] for i in range(6)]


def device_tensors(perturbed_dir, torch):
    """The perturbed checkpoint on the GPU: matrices in bf16 (rounded to
    nearest even by torch, as the server rounds a float32 checkpoint),
    norms in float32, so both unpacking paths run."""
    from serve_tq6_update import read_checkpoint
    out = {}
    for name, a in read_checkpoint(perturbed_dir).items():
        t = torch.from_numpy(a).to("cuda:0")
        out[name] = t.to(torch.bfloat16).contiguous() if t.dim() == 2 else t.contiguous()
    return out


def msgpack(v):
    """Enough msgpack for the frames of the die mode."""
    import struct
    if isinstance(v, dict):
        return bytes([0x80 | len(v)]) + b"".join(msgpack(k) + msgpack(x) for k, x in v.items())
    if isinstance(v, list):
        return bytes([0x90 | len(v)]) + b"".join(msgpack(x) for x in v)
    if isinstance(v, str):
        b = v.encode()
        return (bytes([0xa0 | len(b)]) if len(b) < 32 else bytes([0xd9, len(b)])) + b
    if isinstance(v, int):
        return v.to_bytes(1, "little") if v < 128 else b"\xcf" + struct.pack(">Q", v)
    raise TypeError(type(v))


def die(ep):
    """A trainer that dies mid-update: the group is up, the begin and the
    first bucket's announcement reached the server, the broadcast never
    comes."""
    c = RolloutClient(ep, timeout_ms=120000)
    c.init_weight_group(0)
    hidden = int(os.environ.get("FR_TQ6_HIDDEN", "0"))
    t = {"name": "model.norm.weight", "dtype": "f32", "shape": [hidden]}
    nbytes = 4 * hidden
    begin = msgpack({"type": "update_weights_begin", "v": 1, "version": 100, "tensors": [t], "total_bytes": nbytes,
                     "bucket_bytes": 1 << 20, "transport": "nccl"})
    c._lib.fr_client_send_raw(c._c, begin, len(begin), 0)
    time.sleep(0.5)
    bucket = msgpack({"type": "update_weights_nccl_bucket", "v": 1, "version": 100, "bucket": 0, "nbytes": nbytes,
                      "checksum": 12345, "pieces": [dict(t, offset=0, nbytes=nbytes, at=0)]})
    c._lib.fr_client_send_raw(c._c, bucket, len(bucket), 0)
    time.sleep(0.5)
    os._exit(0)


def wait_idle(c, what, seconds=60):
    end = time.time() + seconds
    while time.time() < end:
        st = c.stats()["server"]
        if not st["updating"]:
            return st
        time.sleep(0.5)
    check(False, f"{what}: the server still stages an update after {seconds} s")
    return c.stats()["server"]


def main_check(main_ep, fresh_ep, perturbed, group_size=2):
    import torch
    torch.cuda.set_device(0)
    prompts = probes()
    c, f = RolloutClient(main_ep, timeout_ms=120000), RolloutClient(fresh_ep, timeout_ms=120000)
    base = greedy(c, prompts)
    want = greedy(f, prompts)
    check(base != want, "the perturbation changes greedy outputs (else the comparison proves nothing)")
    weights = device_tensors(perturbed, torch)

    c.init_weight_group(0)
    check(c.weight_group_size() == group_size, f"the weight group holds the trainer and every rank of the server "
                                               f"({c.weight_group_size()} members, want {group_size})")
    t0 = time.time()
    r = c.update_weights_nccl(weights, version=2, bucket_bytes=1 << 20)
    check(r["weight_version"] == 2, f"update over NCCL committed as version 2 ({time.time() - t0:.2f} s, "
                                    f"{r['bytes']} bytes in 1 MiB buckets)")
    check(greedy(c, prompts) == want, "after the sync, greedy outputs equal a server started from the perturbed "
                                      "checkpoint on disk")

    # refusals: the old weights keep serving, the group ends, a new one works
    try:
        c.update_weights_nccl(weights, version=3, bucket_bytes=1 << 20, _corrupt_bucket=2)
        check(False, "a bucket with a wrong checksum was accepted")
    except ServerError as e:
        check(e.code == "bad_checksum", f"a wrong checksum is refused with bad_checksum (got {e.code})")
    bad = dict(weights)
    k = "model.layers.0.mlp.down_proj.weight"
    bad[k] = weights[k].clone()
    bad[k].view(-1)[12345] = float("nan")
    c.init_weight_group(0)
    try:
        c.update_weights_nccl(bad, version=3, bucket_bytes=4 << 20)
        check(False, "a NaN was accepted")
    except ServerError as e:
        check(e.code == "non_finite" and k in e.message, f"a NaN is refused with non_finite naming {k} ({e.code})")
    st = wait_idle(c, "after the refusals")
    check(st["weight_version"] == 2 and greedy(c, prompts) == want, "after the refusals version 2 still serves")

    # a trainer dying mid-update
    import subprocess
    env = dict(os.environ, FR_TQ6_HIDDEN=str(weights["model.norm.weight"].numel()))
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "die", main_ep], env=env, timeout=120)
    check(child.returncode == 0, "the dying trainer got as far as announcing its first bucket")
    st = wait_idle(c, "after the trainer died", seconds=90)
    check(st["weight_version"] == 2, f"after the trainer died, version 2 still serves (stats {st['weight_version']})")
    check(greedy(c, prompts) == want, "after the trainer died, greedy outputs are unchanged")
    c2 = RolloutClient(main_ep, timeout_ms=120000)
    c2.init_weight_group(0)
    r = c2.update_weights_nccl(weights, version=4)
    check(r["weight_version"] == 4, "a new trainer makes a new group and commits version 4")
    check(greedy(c2, prompts) == want, "greedy outputs after version 4 equal the fresh server's")
    c2.close_weight_group()
    print("weight_sync_nccl: " + ("FAILED: " + "; ".join(FAILED) if FAILED else "all checks passed"), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "die":
        die(sys.argv[2])
    elif len(sys.argv) in (5, 6) and sys.argv[1] == "check":
        sys.exit(main_check(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]) if len(sys.argv) == 6 else 2))
    else:
        sys.exit(__doc__)
