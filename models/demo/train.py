#!/usr/bin/env python3
"""Trains the bundled demo model: a small byte-level Qwen3 on Python source.

The model has the layout `fp4rollout` loads (Qwen3ForCausalLM: RMSNorm,
per-head q/k RMSNorm, RoPE, GQA, SwiGLU, untied embeddings) and the byte
tokenizer of the project's test models: ids 0..255 are bytes, 256 BOS, 257
EOS, 258 PAD, vocabulary 272. Every training sequence starts with BOS, as
every prompt does.

The corpus is the Python standard library of the machine (/usr/lib/python3.*
on Debian), so anyone can retrain it without a download. A fixed 2% of the
files (by a hash of their path) is held out for the validation loss.

    python3 models/demo/train.py --out models/demo --minutes 34 --threads 1

writes model.safetensors (BF16), config.json, generation_config.json and
train_info.json into --out. CPU-only PyTorch is enough; a GPU is used when
there is one. The model card is README.md beside this script.
"""
import argparse
import glob
import json
import math
import os
import random
import sys
import time
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "torch_qwen3"))
from qwen3 import BOS, EOS, PAD, VOCAB, byte_model_config, greedy, new_model, save_checkpoint  # noqa: E402


# --------------------------------------------------------------------------
# The corpus: whole files, a held-out split, BOS-first windows.

def load_corpus(pattern, val_every):
    train, val = [], []
    for path in sorted(glob.glob(pattern, recursive=True)):
        if "/test" in path or "site-packages" in path or "dist-packages" in path:
            continue   # the test suites are large and repetitive
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        if len(data) < 64:
            continue
        (val if zlib.crc32(path.encode()) % val_every == 0 else train).append(data)
    return train, val


class Windows:
    """Random training windows: BOS, then up to seq_len bytes of one file
    from a line start (a third of them from the file's start), EOS at the
    file's end, PAD after it (no loss on PAD)."""

    def __init__(self, files, seq_len, seed):
        self.files, self.seq_len = files, seq_len
        self.rng = random.Random(seed)
        sizes = [len(f) for f in files]
        self.cum = []
        total = 0
        for s in sizes:
            total += s
            self.cum.append(total)
        self.total = total

    def one(self):
        import bisect
        i = bisect.bisect_right(self.cum, self.rng.randrange(self.total))
        data = self.files[i]
        start = 0
        if self.rng.random() > 1 / 3:
            start = self.rng.randrange(len(data))
            nl = data.find(b"\n", start)
            start = 0 if nl < 0 else nl + 1
        ids = [BOS] + list(data[start:start + self.seq_len])
        if len(ids) < self.seq_len + 1:
            ids.append(EOS)
        ids += [PAD] * (self.seq_len + 1 - len(ids))
        return ids

    def batch(self, n):
        return torch.tensor([self.one() for _ in range(n)], dtype=torch.long)


# --------------------------------------------------------------------------
# Training (the model is models/torch_qwen3's).

def loss_of(model, batch):
    logits = model(batch[:, :-1]).float()
    target = batch[:, 1:]
    return F.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1), ignore_index=PAD)


@torch.no_grad()
def validate(model, windows, batches, batch_size):
    model.eval()
    total = sum(loss_of(model, windows.batch(batch_size)).item() for _ in range(batches)) / batches
    model.train()
    return total


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--corpus", default="/usr/lib/python3*/**/*.py", help="glob of the training files")
    ap.add_argument("--minutes", type=float, default=35.0, help="training time budget")
    ap.add_argument("--max-steps", type=int, default=100000)
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--max-position", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads (0: PyTorch's default)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--save-state", help="also save the float32 PyTorch state here (to export again)")
    ap.add_argument("--init-state", help="start from a state --save-state saved (train on: a new warm-up and decay)")
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    if a.threads:
        torch.set_num_threads(a.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    train_files, val_files = load_corpus(a.corpus, 50)
    if not train_files or not val_files:
        raise SystemExit(f"no Python files match {a.corpus!r} (give --corpus)")
    n_bytes = sum(len(f) for f in train_files)
    print(f"corpus: {len(train_files)} training files ({n_bytes} bytes), {len(val_files)} held out", flush=True)
    train, val = Windows(train_files, a.seq_len, a.seed), Windows(val_files, a.seq_len, a.seed + 1)

    cfg = byte_model_config(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.head_dim, a.max_position)
    model = new_model(cfg).to(device)
    if a.init_state:
        model.load_state_dict(torch.load(a.init_state, map_location=device))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params} parameters, {2 * n_params / 1e6:.1f} MB in BF16", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)

    budget, t0, step, seen = a.minutes * 60.0, time.time(), 0, 0
    warmup, ema = 50, None
    while step < a.max_steps and time.time() - t0 < budget:
        frac = min(1.0, (time.time() - t0) / budget)   # cosine decay over the time budget
        lr = a.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        batch = train.batch(a.batch).to(device)
        loss = loss_of(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += int((batch[:, 1:] != PAD).sum())
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0:
            print(f"step {step} loss {ema:.3f} lr {lr:.2e} tokens {seen} {time.time() - t0:.0f}s", flush=True)

    val_loss = validate(model, val, 16, a.batch)
    out = greedy(model, [BOS] + list(b"def "), 48)
    sample = bytes(i for i in out if i < 256).decode("utf-8", "replace")
    print(f"done: {step} steps, {seen} tokens, validation loss {val_loss:.3f} nats/byte", flush=True)
    print(f"greedy after 'def ': {sample!r}", flush=True)

    os.makedirs(a.out, exist_ok=True)
    if a.save_state:
        torch.save(model.state_dict(), a.save_state)
    save_checkpoint(model, cfg, a.out)
    write_json(os.path.join(a.out, "train_info.json"), {
        "name": "demo", "params": n_params, "steps": step, "tokens": seen, "seq_len": a.seq_len,
        "batch": a.batch, "lr": a.lr, "seed": a.seed, "minutes": round((time.time() - t0) / 60.0, 1),
        "device": device, "torch": torch.__version__, "init_state": bool(a.init_state),
        "corpus": "Python standard library sources (%d files, %d bytes)" % (len(train_files), n_bytes),
        "val_files": len(val_files), "val_loss_nats_per_byte": round(val_loss, 4),
        "greedy_after_def": sample,
    })


if __name__ == "__main__":
    main()
