"""Curves of DAPO runs (matplotlib, Agg backend: no display needed).

    python3 plot.py RUN_DIR                       # RUN_DIR/curves.png
    python3 plot.py --compare DIR1 DIR2 DIR3 [--labels bf16,nvfp4,vanilla] --out compare.png [--paired]

--compare draws the runs' metrics.csv in one figure and prints a markdown
table: for each run, the mean of each key column over its first and last
--window steps. --paired adds a second table: every run against the first
(the reference) step by step, the mean difference of each key column with a
95% confidence interval (see `paired_table`), and whether it separates.
"""
import argparse
import csv
import math
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [   # (column, title, log scale)
    ("score_mean", "task score (all samples)", False),
    ("reward_mean", "reward incl. overlong penalty", False),
    ("response_len_mean", "response length (tokens)", False),
    ("mismatch_kl", "mismatch KL (rollout || trainer)", True),
    ("rollout_probs_diff_mean", "mean |p_rollout - p_trainer|", True),
    ("divergence_kl_mean", "KL(BF16 KV || served KV), monitored", True),
    ("tis_truncated_frac", "share of tokens with IS weight > C", False),
    ("clip_frac_high", "share clipped at 1 + eps_high", False),
    ("version_lag_mean", "weight version lag (tokens)", False),
]
# The arithmetic task's diagnostics, drawn when a run has them.
ARITH_PANELS = [
    ("lines_right_mean", "arith: share of column lines exactly right", False),
    ("answer_found_frac", "arith: share with an answer line", False),
    ("truncated_frac", "share cut at max tokens", False),
]
PAIRED = ["score_mean", "reward_mean", "response_len_mean", "divergence_kl_mean", "mismatch_kl",
          "tis_truncated_frac", "lines_right_mean"]
# Two-sided 95% quantiles of Student's t for 1..30 degrees of freedom.
T95 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
       2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
       2.045, 2.042]
TABLE = ["score_mean", "reward_mean", "response_len_mean", "mismatch_kl", "rollout_probs_diff_mean",
         "divergence_kl_mean", "tis_truncated_frac", "groups_kept", "attempts", "step_s"]


def read_csv(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    cols = {}
    for r in rows:
        for k, v in r.items():
            try:
                cols.setdefault(k, []).append(float(v))
            except (TypeError, ValueError):
                cols.setdefault(k, []).append(float("nan"))
    return cols


def _smooth(ys, k):
    if k <= 1:
        return ys
    out = []
    for i in range(len(ys)):
        win = [y for y in ys[max(0, i - k + 1):i + 1] if not math.isnan(y)]
        out.append(sum(win) / len(win) if win else float("nan"))
    return out


def _draw(runs, png, smooth):
    panels = PANELS + (ARITH_PANELS if any("lines_right_mean" in cols for _, cols in runs) else [])
    nrows = (len(panels) + 2) // 3
    fig, axes = plt.subplots(nrows, 3, figsize=(15, 3.7 * nrows))
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (col, title, log) in zip(axes.flat, panels):
        for label, cols in runs:
            if col not in cols:
                continue
            xs, ys = cols["step"], cols[col]
            line, = ax.plot(xs, ys, alpha=0.3 if smooth > 1 else 1.0, marker="." if len(xs) < 30 else None)
            if smooth > 1:
                ax.plot(xs, _smooth(ys, smooth), color=line.get_color(), label=label)
            else:
                line.set_label(label)
            if log and any(y > 0 for y in ys if not math.isnan(y)):
                ax.set_yscale("log")
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def plot_run(csv_path, png_path, smooth=1):
    _draw([(os.path.basename(os.path.dirname(os.path.abspath(csv_path))), read_csv(csv_path))], png_path, smooth)


def _mean(xs):
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else float("nan")


def table(runs, window):
    head = "| run | steps | " + " | ".join(f"{c} (first/last {window})" for c in TABLE) + " |"
    lines = [head, "|" + "---|" * (len(TABLE) + 2)]
    for label, cols in runs:
        n = len(cols.get("step", []))
        cells = []
        for c in TABLE:
            ys = cols.get(c, [])
            cells.append(f"{_mean(ys[:window]):.4g} / {_mean(ys[-window:]):.4g}" if ys else "-")
        lines.append(f"| {label} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def paired_diff(ref, run, block):
    """(mean, low, high, blocks) of run - ref over the steps both have.
    Successive steps of one run are correlated (the policy carries over), so
    the interval is by batch means: the per-step differences are averaged
    over blocks of `block` steps and a Student t interval is taken over the
    block means, which are close to independent when blocks are longer than
    the correlation. With fewer than 2 blocks there is no interval."""
    d = [b - a for a, b in zip(ref, run) if not (math.isnan(a) or math.isnan(b))]
    if not d:
        return float("nan"), float("nan"), float("nan"), 0
    means = [_mean(d[i:i + block]) for i in range(0, len(d) - block + 1, block)] or [_mean(d)]
    m = _mean(d)
    k = len(means)
    if k < 2:
        return m, float("nan"), float("nan"), k
    mb = sum(means) / k
    sd = math.sqrt(sum((x - mb) ** 2 for x in means) / (k - 1))
    half = (T95[k - 2] if k - 1 <= len(T95) else 1.96) * sd / math.sqrt(k)
    return m, m - half, m + half, k


def paired_table(runs, block):
    """Markdown: every run against the first, per column of PAIRED."""
    (ref_label, ref), others = runs[0], runs[1:]
    cols = [c for c in PAIRED if c in ref]
    lines = [f"Paired differences against {ref_label}, step by step: mean [95% CI by batch means over blocks of "
             f"{block} steps]; 'separates' when the interval excludes 0.", "",
             "| run - " + ref_label + " | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for label, c in others:
        cells = []
        for col in cols:
            m, lo, hi, k = paired_diff(ref[col], c.get(col, []), block)
            if math.isnan(lo):
                cells.append(f"{m:.3g} (no CI: {k} block)")
            else:
                cells.append(f"{m:.3g} [{lo:.3g}, {hi:.3g}] " + ("separates" if lo > 0 or hi < 0 else "does not"))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="run folders (each with metrics.csv)")
    ap.add_argument("--compare", action="store_true", help="one figure of all runs, and a markdown table")
    ap.add_argument("--labels", default=None, help="comma-separated labels (default: folder names)")
    ap.add_argument("--out", default=None, help="figure path (default RUN/curves.png, or compare.png)")
    ap.add_argument("--smooth", type=int, default=1, help="moving average over this many steps")
    ap.add_argument("--window", type=int, default=10, help="steps averaged at each end in the table")
    ap.add_argument("--paired", action="store_true", help="also the paired table against the first run")
    ap.add_argument("--block", type=int, default=10, help="steps per block of the paired intervals")
    ap.add_argument("--steps", default="common",
                    help="compare the first N steps of each run; 'common' (default): as many as every run has; "
                         "'all': each run whole")
    a = ap.parse_args()
    labels = a.labels.split(",") if a.labels else [os.path.basename(os.path.abspath(r)) for r in a.runs]
    if len(labels) != len(a.runs):
        sys.exit("plot: one label per run")
    runs = [(lab, read_csv(os.path.join(r, "metrics.csv"))) for lab, r in zip(labels, a.runs)]
    if a.compare or len(runs) > 1:
        # Runs stopped at different steps compare over the steps all have,
        # so "last N" means the same steps for every run.
        if a.steps != "all":
            n = min(len(c.get("step", [])) for _, c in runs) if a.steps == "common" else int(a.steps)
            runs = [(lab, {k: v[:n] for k, v in c.items()}) for lab, c in runs]
            print(f"plot: comparing the first {n} steps of each run", file=sys.stderr)
        out = a.out or "compare.png"
        _draw(runs, out, a.smooth)
        print(table(runs, a.window))
        if a.paired and len(runs) > 1:
            print()
            print(paired_table(runs, a.block))
    else:
        out = a.out or os.path.join(a.runs[0], "curves.png")
        _draw(runs, out, a.smooth)
    print(f"plot: wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
