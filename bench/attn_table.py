#!/usr/bin/env python3
"""Joins bench/attn_decode's CSV and bench/sdpa_decode.py's CSV into the
markdown for bench/RESULTS.md.

usage: attn_table.py ATTN_CSV SDPA_CSV [-o OUT.md] [--title TITLE]

Cases are joined on (shape, batch, context). For every kernel row:
  speedup          = SDPA median time / kernel median time;
  byte-ratio limit = bytes SDPA's row counts / bytes the kernel's row counts,
                     the speedup a purely memory-bound pair would show;
  of limit         = speedup / byte-ratio limit.
Then the issue's targets at 128K context, each case PASS or SHORT with its
figure. Python standard library only.
"""
import argparse
import csv
import sys

TARGET_CONTEXT = 131072
# (kernel, case rule in words, rule on batch, least speedup over SDPA-BF16)
TARGETS = [
    ("nvfp4-bf16", "batch >= 16", lambda b: b >= 16, 3.2),
    ("nvfp4-exact", "batch >= 16", lambda b: b >= 16, 3.0),
    ("mxfp4-bf16", "batch >= 16", lambda b: b >= 16, 3.3),
    ("mxfp4-exact", "batch >= 16", lambda b: b >= 16, 3.1),
    ("fp8", "batch >= 16", lambda b: b >= 16, 1.95),
    ("nvfp4-bf16", "batch 1", lambda b: b == 1, 2.5),
    ("nvfp4-exact", "batch 1", lambda b: b == 1, 2.2),
]
# At the shorter context: no quantized kernel slower than SDPA, and every
# speedup at least this share of the same case's speedup at TARGET_CONTEXT.
SHORT_CONTEXT = 32768
SHORT_SHARE = 0.9
QUANTIZED = ("fp8", "nvfp4-exact", "nvfp4-bf16", "mxfp4-exact", "mxfp4-bf16")


def read_csv(path):
    """(comment lines without '#', rows as dicts)."""
    meta, lines = [], []
    with open(path, newline="") as f:
        for line in f:
            if line.startswith("#"):
                meta.append(line[1:].strip())
            elif line.strip():
                lines.append(line)
    return meta, list(csv.DictReader(lines))


def meta_value(meta, key):
    for m in meta:
        if m.startswith(key + ":"):
            return m[len(key) + 1:].strip()
    return None


def num(row, key):
    try:
        return float(row.get(key) or "")
    except ValueError:
        return None


def key_of(row):
    return (row["shape"], int(row["batch"]), int(row["context"]))


def ok(row):
    return row is not None and row.get("status") == "ok" and num(row, "median_us")


def fmt_ctx(c):
    return f"{c // 1024}K" if c % 1024 == 0 else str(c)


def fmt_bytes(b):
    if b is None:
        return ""
    return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"


def fmt_us(t):
    return f"{t:.1f}" if t >= 100 else f"{t:.2f}"


def ratio(sdpa, row):
    """(speedup, limit) of a kernel row against its SDPA row; None where unknown."""
    limit = None
    if sdpa is not None and num(sdpa, "bytes") and num(row, "bytes"):
        limit = num(sdpa, "bytes") / num(row, "bytes")
    speed = None
    if ok(sdpa) and ok(row):
        speed = num(sdpa, "median_us") / num(row, "median_us")
    return speed, limit


def cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def main():
    ap = argparse.ArgumentParser(description="markdown table of attn_decode against sdpa_decode")
    ap.add_argument("attn_csv")
    ap.add_argument("sdpa_csv")
    ap.add_argument("-o", "--output", help="write here instead of stdout")
    ap.add_argument("--title", default="Decode attention: our kernels against PyTorch SDPA on BF16 KV")
    args = ap.parse_args()

    ameta, arows = read_csv(args.attn_csv)
    smeta, srows = read_csv(args.sdpa_csv)
    sdpa = {key_of(r): r for r in srows}
    kernels, shapes, cases = [], [], {}
    for r in arows:
        if r["kernel"] not in kernels:
            kernels.append(r["kernel"])
        if r["shape"] not in shapes:
            shapes.append(r["shape"])
        cases.setdefault(key_of(r), {})[r["kernel"]] = r
    for k in sdpa:
        if k[0] not in shapes:
            shapes.append(k[0])
    heads = {}
    for r in arows + srows:
        heads.setdefault(r["shape"], f"{r['q_heads']} query / {r['kv_heads']} KV heads, d {r['head_dim']}")

    out = []
    w = out.append
    w(f"## {args.title}\n")
    bw = (meta_value(ameta, "copy_bandwidth_tb_s") or "?").split()[0]
    w(f"- device: {meta_value(ameta, 'device') or 'unknown'}; device-to-device copy {bw} TB/s (read + write)")
    w(f"- PyTorch: {meta_value(smeta, 'torch') or 'unknown'}; GQA via {meta_value(smeta, 'gqa') or 'unknown'}")
    backends = sorted({r.get("backend") for r in srows if r.get("backend")})
    if backends:
        w(f"- SDPA backend(s) seen: {'; '.join(backends)}")
    for name, meta in (("ours", ameta), ("SDPA", smeta)):
        for key in ("l2", "timing"):
            v = meta_value(meta, key)
            if v:
                w(f"- {name}, {key}: {v}")
    for meta in (ameta, smeta):
        v = meta_value(meta, "command")
        if v:
            w(f"- command: `{v}`")
    w("- one decode step of one layer: every sequence attends to `context` tokens "
      "(len = context - 1 cached, 1 new); bytes: ours = pages (codes + scales) + BF16 sink/recent/staging tokens "
      "+ queries, output, block tables; SDPA = K and V once + query + output, all BF16")
    w("- speedup = SDPA time / kernel time; limit = SDPA bytes / kernel bytes (the speedup of a purely "
      "memory-bound pair); of limit = speedup / limit\n")

    # Targets.
    w(f"### Targets (context {fmt_ctx(TARGET_CONTEXT)})\n")
    w("| kernel | cases | need | shape | batch | speedup | limit | result |")
    w("|---|---|---|---|---|---|---|---|")
    summary = []
    for kernel, rule, pred, need in TARGETS:
        figures, missing = [], 0
        for (shape, batch, ctx), by_kernel in sorted(cases.items(), key=lambda kv: (shapes.index(kv[0][0]),) + kv[0][1:]):
            if ctx != TARGET_CONTEXT or not pred(batch):
                continue
            row = by_kernel.get(kernel)
            if row is None:
                continue
            speed, limit = ratio(sdpa.get((shape, batch, ctx)), row)
            if speed is None:
                missing += 1
                why = row.get("error") if not ok(row) else "no SDPA figure"
                w(f"| {kernel} | {rule} | {need:.2f}x | {shape} | {batch} | n/a | "
                  f"{'' if limit is None else f'{limit:.2f}'} | not measured: {cell(why or '')} |")
                continue
            res = "PASS" if speed >= need else "SHORT"
            figures.append((speed, shape, batch, res))
            w(f"| {kernel} | {rule} | {need:.2f}x | {shape} | {batch} | {speed:.2f}x | "
              f"{'' if limit is None else f'{limit:.2f}'} | {res} |")
        if not figures:
            summary.append(f"- {kernel} >= {need:.2f}x, {rule}: not measured")
            continue
        worst = min(figures)
        verdict = "PASS" if all(f[3] == "PASS" for f in figures) and not missing else (
            "SHORT" if any(f[3] == "SHORT" for f in figures) else "incomplete")
        summary.append(f"- {kernel} >= {need:.2f}x, {rule}: **{verdict}** (lowest {worst[0]:.2f}x, "
                       f"{worst[1]} batch {worst[2]}; {len(figures)} case(s)"
                       + (f", {missing} not measured" if missing else "") + ")")
    w("")
    out.extend(summary)
    w("")

    # The short context against the long one.
    short_rows = []
    for (shape, batch, ctx), by_kernel in sorted(cases.items(), key=lambda kv: (shapes.index(kv[0][0]),) + kv[0][1:]):
        if ctx != SHORT_CONTEXT:
            continue
        for kernel in QUANTIZED:
            row, long_row = by_kernel.get(kernel), cases.get((shape, batch, TARGET_CONTEXT), {}).get(kernel)
            if row is None or long_row is None:
                continue
            s_short, _ = ratio(sdpa.get((shape, batch, ctx)), row)
            s_long, _ = ratio(sdpa.get((shape, batch, TARGET_CONTEXT)), long_row)
            if s_short is None or s_long is None:
                continue
            share = s_short / s_long
            res = "PASS" if s_short >= 1.0 and share >= SHORT_SHARE else "SHORT"
            short_rows.append((shape, batch, kernel, s_short, s_long, share, res))
    if short_rows:
        w(f"### {fmt_ctx(SHORT_CONTEXT)} against {fmt_ctx(TARGET_CONTEXT)} "
          f"(need: >= 1.00x over SDPA and >= {SHORT_SHARE:.0%} of the {fmt_ctx(TARGET_CONTEXT)} speedup)\n")
        w(f"| shape | batch | kernel | {fmt_ctx(SHORT_CONTEXT)} | {fmt_ctx(TARGET_CONTEXT)} | share | result |")
        w("|---|---|---|---|---|---|---|")
        for shape, batch, kernel, a, b, share, res in short_rows:
            w(f"| {shape} | {batch} | {kernel} | {a:.2f}x | {b:.2f}x | {share:.0%} | {res} |")
        bad = [r for r in short_rows if r[6] != "PASS"]
        w("")
        w(f"- {fmt_ctx(SHORT_CONTEXT)}: **{'PASS' if not bad else 'SHORT'}** "
          f"({len(short_rows) - len(bad)} of {len(short_rows)} cases)")
        w("")

    # Speedup matrix per shape.
    w("### Speedup over SDPA (byte-ratio limit)\n")
    for shape in shapes:
        keys = sorted({k for k in list(cases) + list(sdpa) if k[0] == shape}, key=lambda k: (k[2], k[1]))
        if not keys:
            continue
        w(f"**{shape}** ({heads.get(shape, '')})\n")
        w("| context | batch | SDPA us | " + " | ".join(kernels) + " |")
        w("|---|---|---|" + "---|" * len(kernels))
        for k in keys:
            s = sdpa.get(k)
            cells = []
            for kern in kernels:
                row = cases.get(k, {}).get(kern)
                if row is None:
                    cells.append("")
                    continue
                speed, limit = ratio(s, row)
                lim = "" if limit is None else f" ({limit:.2f})"
                cells.append(("n/a" if speed is None else f"{speed:.2f}x") + lim)
            w(f"| {fmt_ctx(k[2])} | {k[1]} | {fmt_us(num(s, 'median_us')) if ok(s) else 'n/a'} | "
              + " | ".join(cells) + " |")
        w("")

    # Details per shape.
    for shape in shapes:
        keys = sorted({k for k in list(cases) + list(sdpa) if k[0] == shape}, key=lambda k: (k[2], k[1]))
        if not keys:
            continue
        w(f"### Details: {shape} ({heads.get(shape, '')})\n")
        w("| context | batch | kernel | time (us) | bytes | TB/s | speedup | limit | of limit |")
        w("|---|---|---|---|---|---|---|---|---|")
        for k in keys:
            s = sdpa.get(k)
            if s is not None:
                label = "sdpa-bf16" + (f" [{s['backend']}]" if s.get("backend") else "")
                if ok(s):
                    w(f"| {fmt_ctx(k[2])} | {k[1]} | {cell(label)} | {fmt_us(num(s, 'median_us'))} | "
                      f"{fmt_bytes(num(s, 'bytes'))} | {num(s, 'tb_s'):.2f} | 1.00x | 1.00 | |")
                else:
                    w(f"| {fmt_ctx(k[2])} | {k[1]} | {cell(label)} | n/a: {cell(s.get('error', ''))} | "
                      f"{fmt_bytes(num(s, 'bytes'))} | | | | |")
            for kern in kernels:
                row = cases.get(k, {}).get(kern)
                if row is None:
                    continue
                speed, limit = ratio(s, row)
                lim = "" if limit is None else f"{limit:.2f}"
                if not ok(row):
                    w(f"| {fmt_ctx(k[2])} | {k[1]} | {kern} | n/a: {cell(row.get('error', ''))} | "
                      f"{fmt_bytes(num(row, 'bytes'))} | | | {lim} | |")
                    continue
                sp = "n/a" if speed is None else f"{speed:.2f}x"
                of = "" if speed is None or not limit else f"{100.0 * speed / limit:.0f}%"
                w(f"| {fmt_ctx(k[2])} | {k[1]} | {kern} | {fmt_us(num(row, 'median_us'))} | "
                  f"{fmt_bytes(num(row, 'bytes'))} | {num(row, 'tb_s'):.2f} | {sp} | {lim} | {of} |")
        w("")

    text = "\n".join(out) + "\n"
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
