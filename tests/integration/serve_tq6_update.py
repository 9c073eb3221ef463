"""The trainer-bridge acceptance on tq6 through the Python ctypes client:
`mpirun -np 2 fp4rollout serve` (one engine of tp 2, f32 KV) serves 32 prompts
x 4; once the first sample is done, the client pushes a perturbed copy of
tq6 as version 2; every sample ends in exactly one done, tokens after the
commit carry version 2, and afterwards greedy outputs equal those of a fresh
single-process server started from the perturbed checkpoint on disk.
Started by serve_tq6_update.sh.

usage: serve_tq6_update.py TQ6_DIR OUT_DIR           (writes the perturbed checkpoint)
       serve_tq6_update.py --check MPI_EP FRESH_EP OUT_DIR
"""
import json
import os
import random
import struct
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
import numpy as np  # noqa: E402


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_tq6_update: {what}")


def read_checkpoint(d):
    """Every tensor of a (sharded) safetensors checkpoint as float32."""
    index = os.path.join(d, "model.safetensors.index.json")
    files = sorted(set(json.load(open(index))["weight_map"].values())) if os.path.exists(index) else ["model.safetensors"]
    out = {}
    for f in files:
        raw = open(os.path.join(d, f), "rb").read()
        (n,) = struct.unpack("<Q", raw[:8])
        head = json.loads(raw[8:8 + n])
        for name, t in head.items():
            if name == "__metadata__":
                continue
            a, b = t["data_offsets"]
            buf = raw[8 + n + a:8 + n + b]
            if t["dtype"] == "BF16":
                x = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
            elif t["dtype"] == "F32":
                x = np.frombuffer(buf, dtype=np.float32)
            else:
                raise SystemExit(f"serve_tq6_update: {name} has dtype {t['dtype']}")
            out[name] = x.reshape(t["shape"]).copy()
    return out


def write_checkpoint(src, d, tensors):
    os.makedirs(d, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        if os.path.exists(os.path.join(src, f)):
            open(os.path.join(d, f), "w").write(open(os.path.join(src, f)).read())
    head, off, blobs = {}, 0, []
    for name in sorted(tensors):
        b = tensors[name].astype(np.float32).tobytes()
        head[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [off, off + len(b)]}
        off += len(b)
        blobs.append(b)
    h = json.dumps(head).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def greedy(c, prompts):
    out = {}
    for s in c.generate(prompts, n=1, temperature=0, max_tokens=16, stop_token_ids=[]):
        out[s.request_id] = s.token_ids
    return [out[k] for k in sorted(out)]


def perturb(tq6, out):
    w = read_checkpoint(tq6)
    rng = np.random.default_rng(5)
    # 2% relative noise: the model still writes Python, but its tokens change
    new = {k: (v + 0.02 * np.abs(v).mean() * rng.standard_normal(v.shape)).astype(np.float32) for k, v in w.items()}
    write_checkpoint(tq6, out, new)
    print(f"perturbed tq6: {len(new)} tensors, {sum(v.nbytes for v in new.values())} bytes")


def run_check(mpi_ep, fresh_ep, ckpt):
    from fp4rollout_client import RolloutClient  # noqa: E402
    weights = read_checkpoint(ckpt)
    random.seed(9)
    text = b"def parse(line):\n    fields = line.split(',')\n    return [int(x) for x in fields]\n\nclass "
    prompts = [[256] + list(text[: random.randint(8, len(text))]) for _ in range(32)]
    probe = prompts[:4]
    with RolloutClient(fresh_ep, timeout_ms=120000) as fresh:
        want = greedy(fresh, probe)
    with RolloutClient(mpi_ep, timeout_ms=120000) as c:
        info = c.hello("serve_tq6_update")
        check(info["tp"] == 2 and info["weight_version"] == 0, f"hello: {info}")
        before = greedy(c, probe)
        check(before != want, "tq6 and its perturbed copy give the same greedy tokens")
        for i, p in enumerate(prompts):
            c.submit(p, n=4, temperature=1.0, seed=4, max_tokens=24, stop_token_ids=[], request_id=100 + i,
                     group_id=i)
        got, commit, dt = [], None, 0.0
        for s in c.results():
            got.append(s)
            if commit is None:
                t0 = time.monotonic()
                commit = c.update_weights(weights, version=2)
                dt = time.monotonic() - t0
        keys = [(s.request_id, s.sample) for s in got]
        check(len(keys) == 128 and len(set(keys)) == 128, f"{len(keys)} dones, want 128 distinct")
        nbytes = sum(v.nbytes for v in weights.values())
        check(commit["weight_version"] == 2 and commit["bytes"] == nbytes, f"commit reply {commit}")
        v2 = 0
        for s in got:
            check(len(s.weight_versions) == len(s.token_ids), "one version per token")
            check(s.weight_versions == sorted(s.weight_versions) and set(s.weight_versions) <= {0, 2},
                  f"versions {s.weight_versions}")
            v2 += s.weight_versions[-1] == 2
        check(v2 > 0, "no token drawn after the commit carries version 2")
        after = greedy(c, probe)
        check(after == want, f"greedy after the update {after} differs from the fresh server's {want}")
        print(f"tq6 under mpirun -np 2 (tp 2): 128 dones, {v2} samples end on version 2; update of {nbytes} bytes "
              f"committed in {dt:.2f} s ({nbytes / dt / 2**20:.0f} MiB/s); greedy after it equals a fresh server")


if __name__ == "__main__":
    if sys.argv[1] == "--check":
        run_check(*sys.argv[2:5])
    else:
        perturb(sys.argv[1], sys.argv[2])
