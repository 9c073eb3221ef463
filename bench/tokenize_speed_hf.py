#!/usr/bin/env python3
"""Hugging Face tokenizers measured as bench/tokenize_speed.c measures this
project's tokenizer: load time, then encode MB/s and tokens/s on one thread,
the whole file as one text and each line as its own call, first pass apart
and the median of the others. Prints lines in the same format: rates per
second of the process's CPU time (tokenizers runs on this one thread), the
wall-clock rate in brackets.

    python3 bench/tokenize_speed_hf.py TOKENIZER TEXTFILE [--passes N] [--special]

TOKENIZER: a tokenizer.json or its folder. One thread: RAYON_NUM_THREADS=1
and TOKENIZERS_PARALLELISM=false are set before tokenizers is imported, and
every call is a plain `encode` (no encode_batch).
"""
import argparse
import os
import time

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402  (after the environment above)
from tokenizers import Tokenizer  # noqa: E402


def one_pass(tok, parts, special):
    t0, c0 = time.perf_counter(), time.process_time()
    n = 0
    for p in parts:
        n += len(tok.encode(p, add_special_tokens=special).ids)
    return time.process_time() - c0, n, time.perf_counter() - t0


def report(tok, text, nbytes, lines, special, passes):
    parts = text.splitlines(keepends=True) if lines else [text]
    cold, per_pass, _ = one_pass(tok, parts, special)
    runs = [one_pass(tok, parts, special) for _ in range(passes)]
    med = sorted(r[0] for r in runs)[passes // 2]
    wmed = sorted(r[2] for r in runs)[passes // 2]
    label = "line by line" if lines else "whole file"
    print(f"encode {label:<12} {nbytes / med / 1e6:8.2f} MB/s {per_pass / med:10.0f} tokens/s   "
          f"(wall {nbytes / wmed / 1e6:.2f} MB/s; cold first pass {nbytes / cold / 1e6:.2f} MB/s; {per_pass} tokens, "
          f"{passes} passes)")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tokenizer")
    ap.add_argument("textfile")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--special", action="store_true")
    args = ap.parse_args()
    path = args.tokenizer
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    with open(args.textfile, "rb") as f:
        raw = f.read()
    text = raw.decode("utf-8")
    loads, walls = [], []
    for _ in range(3):
        t0, c0 = time.perf_counter(), time.process_time()
        tok = Tokenizer.from_file(path)
        loads.append(time.process_time() - c0)
        walls.append(time.perf_counter() - t0)
    print(f"tokenizer {args.tokenizer} (Hugging Face tokenizers {tokenizers.__version__}, Python): "
          f"vocabulary {tok.get_vocab_size(with_added_tokens=True)}; text {args.textfile}: {len(raw)} bytes")
    print(f"load {loads[0]:.3f} s (first), {min(loads):.3f} s (best of 3) of CPU time (wall, best: {min(walls):.3f} s)")
    passes = max(1, args.passes)
    report(tok, text, len(raw), False, args.special, passes)
    report(tok, text, len(raw), True, args.special, passes)


if __name__ == "__main__":
    main()
