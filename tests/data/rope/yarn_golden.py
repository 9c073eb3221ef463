#!/usr/bin/env python3
"""Writes yarn_golden.txt: YaRN RoPE frequencies and scales computed from the
published formulas (the YaRN paper, arXiv 2309.00071, as transformers and
DeepSeek-V2/V3 apply them), independently of the engine, with the standard
library only. float32 steps are emulated by rounding every result to float32.

Usage: python3 tests/data/rope/yarn_golden.py > tests/data/rope/yarn_golden.txt
"""
import math
import struct


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def mscale(scale, m):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def correction_dim(rotations, dim, theta, original):
    # The pair index whose wavelength fits `rotations` times into the window.
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))


def yarn(theta, dim, factor, original, beta_fast=32.0, beta_slow=1.0, ms=0.0, ms_all=0.0, attn=0.0,
         truncate=True):
    low = correction_dim(beta_fast, dim, theta, original)
    high = correction_dim(beta_slow, dim, theta, original)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    lo, hi = low, high
    if hi == lo:
        hi += 0.001
    inv = []
    for i in range(dim // 2):
        pf = f32(math.pow(f32(theta), f32(f32(2 * i) / f32(dim))))
        extra = f32(1.0 / pf)
        inter = f32(1.0 / f32(f32(factor) * pf))
        ramp = f32(f32(f32(i) - f32(lo)) / f32(hi - lo))
        ramp = min(max(ramp, 0.0), 1.0)
        e = f32(1.0 - ramp)
        inv.append(f32(f32(inter * f32(1.0 - e)) + f32(extra * e)))
    if attn > 0:
        af = attn
    elif ms and ms_all:
        af = mscale(factor, ms) / mscale(factor, ms_all)
    else:
        af = mscale(factor, 1.0)
    soft = mscale(factor, ms_all) ** 2 if ms_all else 1.0
    return low, high, af, soft, inv


# name, theta, dim, factor, original, beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor, truncate
CASES = [
    ("deepseek-v3", 10000.0, 64, 40.0, 4096, 32.0, 1.0, 1.0, 1.0, 0.0, True),
    ("deepseek-v2-lite", 10000.0, 64, 40.0, 4096, 32.0, 1.0, 0.707, 0.707, 0.0, True),
    ("qwen3", 1000000.0, 128, 4.0, 32768, 32.0, 1.0, 0.0, 0.0, 0.0, True),
    ("qwen3-untruncated", 1000000.0, 128, 4.0, 32768, 32.0, 1.0, 0.0, 0.0, 0.0, False),
    ("tiny-dsmoe", 10000.0, 64, 4.0, 16, 32.0, 1.0, 1.0, 0.5, 0.0, True),
    ("given-factor", 10000.0, 8, 2.0, 64, 8.0, 2.0, 0.0, 0.0, 1.5, False),
    ("factor-one", 10000.0, 64, 1.0, 4096, 32.0, 1.0, 0.0, 0.0, 0.0, True),
]


def main():
    print("# YaRN golden values written by yarn_golden.py; one case per 'case' line:")
    print("# case NAME THETA DIM FACTOR ORIGINAL BETA_FAST BETA_SLOW MSCALE MSCALE_ALL_DIM ATTENTION_FACTOR TRUNCATE")
    print("# range LOW HIGH / scales ATTENTION_FACTOR SOFTMAX_MULTIPLIER / inv DIM/2 float32 values")
    for name, theta, dim, factor, orig, bf, bs, ms, msa, attn, trunc in CASES:
        low, high, af, soft, inv = yarn(theta, dim, factor, orig, bf, bs, ms, msa, attn, trunc)
        print("case %s %r %d %r %d %r %r %r %r %r %d" % (name, theta, dim, factor, orig, bf, bs, ms, msa, attn,
                                                      int(trunc)))
        print("range %.17g %.17g" % (low, high))
        print("scales %.17g %.17g" % (af, soft))
        print("inv " + " ".join("%.9e" % v for v in inv))


if __name__ == "__main__":
    main()
