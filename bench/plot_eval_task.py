#!/usr/bin/env python3
"""Draws `fp4rollout eval-task --json` output: exact-match accuracy with its
95% Wilson interval for every KV configuration, one panel per variant, the
context on the x axis (one curve per configuration; a single context gives
one point per configuration, spread sideways so that the intervals do not
overlap). matplotlib with the Agg backend: no display needed.

    python3 bench/plot_eval_task.py eval_task.jsonl --out bench/figures/retrieval_768.png \\
        [--title "retrieval, 768 bytes"]

Refuses (exit 1, a message) a file without eval-task's JSON lines.
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def die(msg):
    print("plot_eval_task: " + msg, file=sys.stderr)
    sys.exit(1)


def read(path):
    """{variant: {config: [(context, accuracy, lo, hi)]}} and the configurations in file order."""
    cells, configs = {}, []
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                    variant, config, context = r["variant"], r["config"], r["context"]
                    acc, (lo, hi) = r["accuracy"], r["ci95"]
                except (ValueError, KeyError, TypeError) as e:
                    die("%s line %d: not an eval-task JSON line (%s)" % (path, n, e))
                if variant == "all":
                    continue
                if config not in configs:
                    configs.append(config)
                cells.setdefault(variant, {}).setdefault(config, []).append((context, acc, lo, hi))
    except OSError as e:
        die("%s: %s" % (path, e))
    if not cells:
        die("%s: no (variant, context) cell" % path)
    return cells, configs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jsonl", help="eval-task --json output")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--title", default="", help="the figure's title")
    a = ap.parse_args()
    cells, configs = read(a.jsonl)
    fig, axes = plt.subplots(1, len(cells), figsize=(max(8, 6 * len(cells)), 4.6), squeeze=False)
    for ax, (variant, by_config) in zip(axes[0], sorted(cells.items())):
        contexts = sorted({c for pts in by_config.values() for c, *_ in pts})
        single = len(contexts) == 1
        for i, config in enumerate(configs):
            pts = sorted(by_config.get(config, []))
            if not pts:
                continue
            xs = [i if single else c for c, *_ in pts]
            ys = [100 * acc for _, acc, _, _ in pts]
            err = [[100 * (acc - lo) for _, acc, lo, _ in pts], [100 * (hi - acc) for _, acc, _, hi in pts]]
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=4, linestyle="none" if single else "-", label=config)
        if single:
            ax.set_xticks(range(len(configs)))
            ax.set_xticklabels(configs, rotation=30, ha="right")
            ax.set_xlabel("KV cache configuration (context %d bytes)" % contexts[0])
        else:
            ax.set_xscale("log", base=2)
            ax.set_xticks(contexts)
            ax.set_xticklabels([str(c) for c in contexts])
            ax.set_xlabel("context (bytes of prompt)")
            ax.legend(fontsize=8)
        ax.set_ylabel("exact match %, 95% Wilson interval")
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
        ax.set_title(variant)
    if a.title:
        fig.suptitle(a.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("plot_eval_task: wrote %s (%d configurations, %d variants)" % (a.out, len(configs), len(cells)))


if __name__ == "__main__":
    main()
