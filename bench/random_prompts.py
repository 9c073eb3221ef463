#!/usr/bin/env python3
"""Prompts of random token ids for throughput runs on synthetic weights,
one per line, comma-separated (the `--prompts` format of `fp4rollout
rollout` and `fp4rollout-client generate`).

    python3 bench/random_prompts.py COUNT LENGTH VOCAB [--seed S] > prompts.txt

The ids are uniform in [0, VOCAB); with synthetic weights only the lengths
matter to the speed, not which ids they are.
"""
import argparse
import random


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("count", type=int)
    ap.add_argument("length", type=int)
    ap.add_argument("vocab", type=int)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.count < 1 or a.length < 1 or a.vocab < 1:
        ap.error("COUNT, LENGTH and VOCAB must be positive")
    r = random.Random(a.seed)
    for _ in range(a.count):
        print(",".join(str(r.randrange(a.vocab)) for _ in range(a.length)))


if __name__ == "__main__":
    main()
