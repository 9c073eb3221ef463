#!/usr/bin/env python3
"""Weight sync over ZeroMQ on loopback: `fp4rollout-client push-weights` into
a running `fp4rollout serve` (CPU backend), timed from the first begin message
to the commit reply, for a random Qwen3-shaped checkpoint written here.

    python3 bench/weight_sync.py [--hidden 1024 --layers 20 --intermediate 3072
                                  --vocab 32000] [--dtypes f32,bf16] [--runs 3]
                                  [--bucket-mib 512] [--dir DIR] [--build build]
                                  [--model SPEC] [--backend cpu|cuda]

Prints one markdown row per push (bytes, seconds, MiB/s, and the server's own
time to switch the staged weights in) and a summary per dtype. Needs numpy
for writing the checkpoint (once: an existing DIR/model.safetensors is kept).
--preset qwen3-4b writes a checkpoint of Qwen3-4B's shape instead (4.0 B
parameters, tied embeddings, stored as BF16: 8 GB; 16 GB sent as float32),
for the figure on a GPU machine with --backend cuda --dtypes bf16. Its
values are one random block repeated at shifting offsets (generating 4 B
normal deviates would take minutes; a sync only moves bytes). --model
pushes an existing checkpoint folder instead.
"""
import argparse
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import time


PRESETS = {"qwen3-4b": dict(hidden=2560, layers=36, inter=9728, vocab=151936, heads=32, kv_heads=8, head_dim=128,
                           tie=True, dtype="BF16")}


def qwen3_shapes(hidden, layers, inter, vocab, heads, kv_heads, head_dim, tie=False):
    """The Hugging Face names and shapes of a Qwen3 checkpoint's tensors."""
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
                   (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)),
                   (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
                   (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
                   (p + "self_attn.q_norm.weight", (head_dim,)), (p + "self_attn.k_norm.weight", (head_dim,)),
                   (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter))]
    return shapes + [("model.norm.weight", (hidden,))] + ([] if tie else [("lm_head.weight", (vocab, hidden))])


def start_server(build, model, backend, d, env=None, wait_s=60, tp=1, launcher=()):
    """`fp4rollout serve` holding `model` (one sequence, BF16 KV; tp ranks
    under `launcher`, e.g. mpirun), its config and log in folder d; returns
    (process, port, log path) once it listens."""
    port = free_port()
    cfg = os.path.join(d, "serve.json")
    json.dump({"model": os.path.abspath(model) if os.path.isdir(model) else model, "backend": backend,
               "kv_dtype": "bf16", "max_seqs": 1, "kv_blocks": 4, "tp": tp,
               "coordinator": {"bind": "127.0.0.1", "port": port}}, open(cfg, "w"))
    log_path = os.path.join(d, "serve.log")
    srv = subprocess.Popen(list(launcher) + [os.path.join(build, "fp4rollout"), "serve", "--config", cfg],
                           stderr=open(log_path, "w"), env=env)
    for _ in range(int(wait_s * 10)):
        if "listening on" in open(log_path).read():
            return srv, port, log_path
        if srv.poll() is not None:
            sys.exit("the server exited at start:\n" + open(log_path).read())
        time.sleep(0.1)
    srv.terminate()
    sys.exit(f"the server did not start within {wait_s} s:\n" + open(log_path).read())


def write_checkpoint(d, hidden, layers, inter, vocab, heads, kv_heads, head_dim, tie=False, dtype="F32"):
    import numpy as np
    os.makedirs(d, exist_ok=True)
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": hidden,
           "num_hidden_layers": layers, "intermediate_size": inter, "vocab_size": vocab,
           "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": tie, "bos_token_id": 1, "eos_token_id": 2}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"), indent=1)
    shapes = qwen3_shapes(hidden, layers, inter, vocab, heads, kv_heads, head_dim, tie)
    esize = 2 if dtype == "BF16" else 4
    header, off = {}, 0
    for name, shape in shapes:
        n = esize * int(np.prod(shape))
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    rng = np.random.default_rng(0)
    block = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float32)
    shift = 0
    with open(os.path.join(d, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for name, shape in shapes:
            count = int(np.prod(shape))
            if len(shape) == 1:
                a = np.ones(count, np.float32)
            elif count <= block.size:
                a = rng.standard_normal(count, dtype=np.float32) * 0.02
            else:   # large matrices: the random block, rotated, repeated
                shift = (shift + 7919) % block.size
                a = np.resize(np.roll(block, shift), count)
            if dtype == "BF16":   # round to nearest even, as a trainer's cast does
                u = a.astype(np.float32).view(np.uint32)
                a = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            f.write(np.ascontiguousarray(a).tobytes())
    return off


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=20)
    ap.add_argument("--intermediate", type=int, default=3072)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtypes", default="f32,bf16")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=512)
    ap.add_argument("--dir", help="checkpoint folder (written when it has no model.safetensors)")
    ap.add_argument("--build", default=os.environ.get("BUILD", "build"))
    ap.add_argument("--model", help="push this model (folder or synthetic:NAME) instead of writing one")
    ap.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--preset", choices=sorted(PRESETS), help="write a checkpoint of this shape")
    a = ap.parse_args()
    if not os.path.isdir(a.build):   # relative to the repository when not to the working directory
        a.build = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), a.build)
    d = a.dir or os.path.join(tempfile.gettempdir(), "fp4rollout_weight_sync_" + (a.preset or "ckpt"))
    model = a.model or d
    os.makedirs(d, exist_ok=True)
    if not a.model and not os.path.exists(os.path.join(d, "model.safetensors")):
        print(f"writing the checkpoint to {d} ...", file=sys.stderr)
        if a.preset:
            write_checkpoint(d, **PRESETS[a.preset])
        else:
            write_checkpoint(d, a.hidden, a.layers, a.intermediate, a.vocab, a.heads, a.kv_heads, a.head_dim)
    srv, port, log_path = start_server(a.build, model, a.backend, d)
    try:
        rows, version = [], 0
        print("| sent as | bytes | bucket MiB | seconds | MiB/s | switch into the serving weights (ms) |")
        print("|---|---|---|---|---|---|")
        for dt in a.dtypes.split(","):
            for _ in range(a.runs):
                version += 1
                out = subprocess.run([os.path.join(a.build, "fp4rollout-client"), "--endpoint",
                                      f"tcp://127.0.0.1:{port}", "--timeout-ms", "600000", "push-weights",
                                      "--model", model, "--version", str(version), "--dtype", dt,
                                      "--bucket-mib", str(a.bucket_mib)], capture_output=True, text=True)
                if out.returncode:
                    sys.exit(f"push-weights failed: {out.stderr}")
                r = json.loads(out.stdout.strip().splitlines()[-1])
                time.sleep(0.2)
                m = re.findall(rf"now version {version} .*switched in ([0-9.]+) ms", open(log_path).read())
                sw = float(m[-1]) if m else float("nan")
                rows.append((dt, r["bytes"], r["seconds"]))
                print(f"| {dt} | {r['bytes']:,} | {a.bucket_mib} | {r['seconds']:.3f} | {r['mib_per_s']:.0f} | {sw:.0f} |",
                      flush=True)
        for dt in a.dtypes.split(","):
            s = [x for x in rows if x[0] == dt]
            best = min(x[2] for x in s)
            print(f"{dt}: best {s[0][1] / best / 2**20:.0f} MiB/s ({s[0][1] / best / 1e9:.2f} GB/s) over {len(s)} runs",
                  file=sys.stderr)
    finally:
        srv.terminate()
        srv.wait(timeout=60)


if __name__ == "__main__":
    main()
