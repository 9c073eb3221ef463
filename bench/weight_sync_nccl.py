#!/usr/bin/env python3
"""Weight sync over NCCL against ZeroMQ, Qwen3-4B-shaped: the server
(`fp4rollout serve --model synthetic:qwen3-4b`, CUDA backend) on GPU 1 (with
--tp N: N ranks under mpirun on GPUs 1..N, each keeping its shard of every
bucket), the trainer (this process, PyTorch) on GPU 0 with random bf16
weights of Qwen3-4B's names and shapes (tied embeddings: about 8 GB).
Measured in one run: the NVLink copy bandwidth GPU 0 -> GPU 1 (torch, a 2
GiB buffer, CUDA events), the NCCL update from its begin to the commit reply
(RolloutClient.update_weights_nccl, several runs; at tp N one broadcast per
bucket reaches every rank), and the same weights over ZeroMQ
(RolloutClient.update_weights from host copies, loopback).

    python3 bench/weight_sync_nccl.py [--tp 2] [--runs 5] [--zmq-runs 1] [--bucket-mib 512] [--build build]

Prints a markdown table. Needs PyTorch with CUDA and tp + 1 GPUs (mpirun
for tp > 1).
"""
import argparse
import os
import re
import statistics
import sys
import tempfile
import time

here = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(here, "..", "trainer_bridge", "client", "python"))

from weight_sync import PRESETS, qwen3_shapes, start_server  # noqa: E402  (this folder)

Q4B = {k: v for k, v in PRESETS["qwen3-4b"].items() if k != "dtype"}   # rollout/synthetic_model.c's qwen3-4b


def nvlink_gbps(torch, nbytes=2 << 30, reps=10):
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    b.copy_(a)
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(0):
        start.record()
        for _ in range(reps):
            b.copy_(a, non_blocking=True)
        end.record()
        end.synchronize()
    ms = start.elapsed_time(end)
    del a, b
    torch.cuda.empty_cache()
    return nbytes * reps / (ms * 1e-3) / 1e9


def torch_nccl_dir(torch):
    """The folder of the libnccl this process has loaded (PyTorch's), or None."""
    torch.cuda.init()
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1]
            if "libnccl.so" in os.path.basename(path):
                return os.path.dirname(path)
    return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--zmq-runs", type=int, default=1)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--tp", type=int, default=1)
    a = ap.parse_args()
    if not os.path.isdir(a.build):
        a.build = os.path.join(os.path.dirname(here), a.build)
    os.environ.setdefault("FP4ROLLOUT_CLIENT_LIB", os.path.join(os.path.abspath(a.build), "libfp4rollout_client.so"))
    import torch
    from fp4rollout_client import RolloutClient
    if torch.cuda.device_count() < a.tp + 1:
        sys.exit(f"needs {a.tp + 1} GPUs (the trainer and {a.tp} server ranks)")
    gbps = nvlink_gbps(torch)

    d = tempfile.mkdtemp(prefix="fp4rollout_nccl_bench_")
    # rank r's device r is GPU r + 1; GPU 0 stays visible for peer access
    order = ",".join(str(i) for i in list(range(1, a.tp + 1)) + [0])
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=order, NCCL_NVLS_ENABLE="0")
    launcher = ()
    if a.tp > 1:
        launcher = ["mpirun", "--oversubscribe", "-x", "NCCL_NVLS_ENABLE", "-x", "LD_LIBRARY_PATH", "-x",
                    "CUDA_VISIBLE_DEVICES", "-np", str(a.tp)] + (["--allow-run-as-root"] if os.getuid() == 0 else [])
    # NCCL refuses a group whose members run different NCCL versions: the
    # server loads the library this process (PyTorch) loaded.
    nccl = torch_nccl_dir(torch)
    if nccl:
        env["LD_LIBRARY_PATH"] = nccl + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    srv, port, log_path = start_server(a.build, "synthetic:qwen3-4b", "cuda", d, env=env, wait_s=120, tp=a.tp,
                                       launcher=launcher)
    try:
        torch.cuda.set_device(0)
        g = torch.Generator(device="cuda:0").manual_seed(0)
        weights = {}
        for name, shp in qwen3_shapes(**Q4B):
            if len(shp) == 1:
                weights[name] = torch.ones(shp, dtype=torch.bfloat16, device="cuda:0")
            else:
                weights[name] = (torch.randn(shp, generator=g, device="cuda:0") * 0.02).to(torch.bfloat16)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        torch.cuda.synchronize()
        bucket = a.bucket_mib << 20
        c = RolloutClient(f"tcp://127.0.0.1:{port}", timeout_ms=600000)
        c.init_weight_group(0)
        assert c.weight_group_size() == a.tp + 1, c.weight_group_size()
        versions = iter(range(1, a.runs + a.zmq_runs + 1))

        def timed(n, push):   # seconds of n pushes, each to the next version
            out = []
            for _ in range(n):
                version = next(versions)
                t0 = time.perf_counter()
                r = push(version)
                out.append(time.perf_counter() - t0)
                assert r["weight_version"] == version, r
            return out

        nccl = timed(a.runs, lambda v: c.update_weights_nccl(weights, version=v, bucket_bytes=bucket))
        c.close_weight_group()
        host = {k: t.cpu() for k, t in weights.items()}
        zmq = timed(a.zmq_runs, lambda v: c.update_weights(host, version=v, bucket_bytes=bucket))
        switches = [float(x) for x in re.findall(r"over NCCL \([0-9]+ bytes; switched in ([0-9.]+) ms",
                                                    open(log_path).read())]
        print(f"Qwen3-4B shape, bf16, {total:,} bytes ({total / 1e9:.2f} GB), buckets of {a.bucket_mib} MiB; "
              f"trainer on GPU 0 (PyTorch), server on GPU{'s 1-' + str(a.tp) if a.tp > 1 else ' 1'} (tp {a.tp})\n")
        print("| path | runs | best s | median s | GB/s (best) |")
        print("|---|---|---|---|---|")
        print(f"| NCCL, begin to commit reply | {len(nccl)} | {min(nccl):.3f} | {statistics.median(nccl):.3f} | "
              f"{total / min(nccl) / 1e9:.1f} |")
        print(f"| ZeroMQ (loopback, from host memory), begin to commit reply | {len(zmq)} | {min(zmq):.3f} | "
              f"{statistics.median(zmq):.3f} | {total / min(zmq) / 1e9:.2f} |")
        print(f"| NVLink copy GPU 0 -> GPU 1 (torch, 2 GiB x 10) | 1 | | | {gbps:.1f} |")
        if switches:
            print(f"\nserver-side switch of the staged weights into the serving ones (device to device): "
                  f"median {statistics.median(switches):.1f} ms")
    finally:
        srv.terminate()
        srv.wait(timeout=120)


if __name__ == "__main__":
    main()
