#!/usr/bin/env python3
"""Rewrites a checkpoint's float32 tensors whose values are all BF16 values
as BF16 tensors, bit for bit the same numbers in half the bytes; any other
tensor (dsmoe's e_score_correction_bias, kept in float32 as DeepSeek's own
checkpoints keep it) is copied as it is.

train_dsmoe.py writes float32 files whose weights it has rounded to BF16
values; the copies kept in the repository (models/dsmoe/dsmoe,
models/dsmoe/dsmoe2) went through this script, so that they take half the
space and load to the same weights:

    python3 models/dsmoe/store_bf16.py OUT/dsmoe/model.safetensors models/dsmoe/dsmoe/model.safetensors

Needs NumPy. Refuses (exit 1, nothing written) a file that is not
safetensors or holds no float32 tensor that converts exactly.
"""
import argparse
import json
import struct
import sys

import numpy as np


def die(msg):
    print("store_bf16: " + msg, file=sys.stderr)
    sys.exit(1)


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        die("%s: too short for a safetensors file" % path)
    n = struct.unpack("<Q", raw[:8])[0]
    try:
        header = json.loads(raw[8:8 + n])
    except ValueError as e:
        die("%s: the header is not JSON (%s)" % (path, e))
    return header, memoryview(raw)[8 + n:]


def convert(header, data):
    """(new header, blobs, names converted)."""
    out, blobs, at, converted = {}, [], 0, []
    for name in sorted(k for k in header if k != "__metadata__"):
        t = header[name]
        a, b = t["data_offsets"]
        blob = bytes(data[a:b])
        dtype = t["dtype"]
        if dtype == "F32":
            words = np.frombuffer(blob, dtype="<u4")
            if not (words & 0xFFFF).any():
                blob = (words >> 16).astype("<u2").tobytes()
                dtype = "BF16"
                converted.append(name)
        out[name] = {"dtype": dtype, "shape": t["shape"], "data_offsets": [at, at + len(blob)]}
        blobs.append(blob)
        at += len(blob)
    if "__metadata__" in header:
        out["__metadata__"] = header["__metadata__"]
    return out, blobs, converted


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", help="the float32 model.safetensors")
    ap.add_argument("dst", help="where the converted file goes")
    a = ap.parse_args()
    header, data = read(a.src)
    out, blobs, converted = convert(header, data)
    if not converted:
        die("%s: no float32 tensor holds only BF16 values; nothing written" % a.src)
    h = json.dumps(out, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(a.dst, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    kept = [k for k in out if k != "__metadata__" and k not in converted]
    print("store_bf16: %s: %d tensors in BF16, %d kept as they were%s" % (
        a.dst, len(converted), len(kept), (" (" + ", ".join(kept) + ")") if kept and len(kept) <= 4 else ""))


if __name__ == "__main__":
    main()
