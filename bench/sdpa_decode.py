#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention on a BF16 KV cache: the peer of
bench/attn_decode.c, for the same (shape, batch, context) cases.

One decode step of one layer: q [batch, q_heads, 1, d], k and v
[batch, kv_heads, context, d], contiguous BF16 on the GPU, no mask, default
scale 1/sqrt(d). Grouped-query attention goes through enable_gqa=True; on a
PyTorch without it, k and v are repeat_interleave'd to q_heads before timing
(the "gqa" column says which; the latter reads G times the KV bytes).

Timing is the same as attn_decode's: one sample is one SDPA call between two
torch.cuda.Event records on the current stream; after --warmup calls, --runs
calls are enqueued behind a GPU sleep (torch.cuda._sleep) long enough for the
host to enqueue them all, so the samples hold GPU time only; the median is
reported. L2 is defeated the same way: when a call moves less than
max(4 x L2, --rotate-mb), the case holds copies = 1 + ceil(rotation / bytes)
independent (q, k, v) sets and call i uses set i mod copies.

bytes = K and V once (2 * batch * kv_heads * context * d * 2), the BF16 query
and the BF16 output: the least any kernel must move for this step.

The backend that ran (flash, efficient, cudnn, math) is read from a profiler
trace of one call (op and kernel names) unless --no-backend.

Output: CSV on stdout (one row per case, '#' comment lines first), progress
on stderr.
"""
import argparse
import math
import statistics
import sys

import torch
import torch.nn.functional as F

SHAPES = {"qwen3-4b": (32, 8, 128), "qwen3-14b": (40, 8, 128), "qwen3-30b-a3b": (32, 4, 128)}
HEADER = ["shape", "q_heads", "kv_heads", "head_dim", "batch", "context", "kernel", "status", "median_us",
          "min_us", "max_us", "runs", "copies", "bytes", "tb_s", "backend", "gqa", "error"]
CHUNK = 50


def parse_ints(text):
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        mult = 1
        if tok[-1:] in ("K", "k"):
            mult, tok = 1024, tok[:-1]
        elif tok[-1:] in ("M", "m"):
            mult, tok = 1048576, tok[:-1]
        v = int(tok) * mult
        if v <= 0:
            raise argparse.ArgumentTypeError("values must be positive")
        out.append(v)
    return out


def parse_shapes(text):
    """Names as attn_decode spells them: known names or Q:KV[:D] -> q{Q}kv{KV}d{D}."""
    out = []
    for tok in text.split(","):
        tok = tok.strip()
        if tok in SHAPES:
            out.append((tok,) + SHAPES[tok])
            continue
        parts = tok.split(":")
        if len(parts) not in (2, 3):
            raise argparse.ArgumentTypeError(f"unknown shape {tok}")
        q, kv = int(parts[0]), int(parts[1])
        d = int(parts[2]) if len(parts) == 3 else 128
        if q < 1 or kv < 1 or q % kv:
            raise argparse.ArgumentTypeError(f"bad shape {tok}")
        out.append((f"q{q}kv{kv}d{d}", q, kv, d))
    return out


def csv_field(x):
    s = "" if x is None else str(x)
    if any(c in s for c in ',"\n\r'):
        s = '"' + s.replace('"', '""').replace("\n", " ").replace("\r", " ") + '"'
    return s


def emit(row):
    print(",".join(csv_field(row.get(k)) for k in HEADER), flush=True)


def gqa_mode(dev):
    q = torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16, device=dev)
    k = torch.zeros(1, 2, 8, 16, dtype=torch.bfloat16, device=dev)
    try:
        F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
        return "enable_gqa"
    except TypeError:
        return "repeat_interleave"


def sleep_cycles_per_ms():
    """Cycles of torch.cuda._sleep per millisecond, or None without it."""
    if not hasattr(torch.cuda, "_sleep"):
        return None
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    s.record()
    torch.cuda._sleep(2_000_000)
    e.record()
    e.synchronize()
    ms = s.elapsed_time(e)
    return 2_000_000 / ms if ms > 0 else None


def detect_backend(call):
    """Backend of one call from its profiler trace: the aten SDPA op and the attention kernels."""
    try:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU]
        if hasattr(ProfilerActivity, "CUDA"):
            acts.append(ProfilerActivity.CUDA)
        with profile(activities=acts) as prof:
            call()
            torch.cuda.synchronize()
        names = [e.name for e in prof.events()]
    except Exception as ex:  # the profiler is a convenience, never a failure
        return f"unknown ({type(ex).__name__})"
    op = next((n for n in names if n.startswith("aten::_scaled_dot_product_") or n.startswith("aten::_flash")
               or n.startswith("aten::_efficient") or n.startswith("aten::_cudnn")), None)
    kernels = []
    for n in names:
        low = n.lower()
        if any(w in low for w in ("flash", "fmha", "cudnn", "attention", "sdpa")) and not n.startswith("aten::"):
            short = n.replace("void ", "").split("<")[0].split("(")[0].strip()
            if short and short not in kernels:
                kernels.append(short)
    text = " ".join(kernels + [op or ""]).lower()
    if "cudnn" in text:
        kind = "cudnn"
    elif "flash" in text:
        kind = "flash"
    elif "efficient" in text or "fmha" in text or "cutlass" in text:
        kind = "efficient"
    elif op:
        kind = "math"
    else:
        kind = "unknown"
    detail = "+".join(kernels[:3]) or (op or "")
    return f"{kind} ({detail})" if detail else kind


def make_sets(batch, qh, kvh, ctx, d, copies, repeat, dev, seed):
    """copies independent (q, k, v) sets; k and v repeated `repeat` times along heads when > 1."""
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    sets = []
    for _ in range(copies):
        q = torch.randn(batch, qh, 1, d, dtype=torch.bfloat16, device=dev, generator=gen)
        k = torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev, generator=gen)
        v = torch.randn(batch, kvh, ctx, d, dtype=torch.bfloat16, device=dev, generator=gen)
        if repeat > 1:
            k = k.repeat_interleave(repeat, dim=1).contiguous()
            v = v.repeat_interleave(repeat, dim=1).contiguous()
        sets.append((q, k, v))
    torch.cuda.synchronize()
    return sets


def run_case(shape, batch, ctx, args, dev, gqa, cycles_per_ms, rotate_bytes):
    name, qh, kvh, d = shape
    g = qh // kvh
    row = {"shape": name, "q_heads": qh, "kv_heads": kvh, "head_dim": d, "batch": batch, "context": ctx,
           "kernel": "sdpa-bf16", "runs": args.runs, "gqa": gqa}
    nbytes = 2 * batch * kvh * ctx * d * 2 + 2 * batch * qh * d * 2
    row["bytes"] = nbytes
    copies = 1 if nbytes >= rotate_bytes else 1 + math.ceil(rotate_bytes / nbytes)
    row["copies"] = copies
    try:
        sets = make_sets(batch, qh, kvh, ctx, d, copies, g if gqa == "repeat_interleave" else 1, dev,
                         args.seed + 7919 * (batch * 1000003 + ctx))
    except RuntimeError as ex:  # out of memory among others
        torch.cuda.empty_cache()
        row.update(status="n/a", error=f"allocation failed: {str(ex).splitlines()[0]}")
        return row

    if gqa == "enable_gqa":
        def call(i):
            q, k, v = sets[i % copies]
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    else:
        def call(i):
            q, k, v = sets[i % copies]
            return F.scaled_dot_product_attention(q, k, v)

    try:
        for i in range(args.warmup):
            call(i)
        torch.cuda.synchronize()
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(args.runs)]
        for r0 in range(0, args.runs, CHUNK):
            r1 = min(r0 + CHUNK, args.runs)
            if cycles_per_ms:
                torch.cuda._sleep(int(cycles_per_ms * (1.0 + 0.2 * (r1 - r0))))  # 0.2 ms of head start per call
            for i in range(r0, r1):
                starts[i].record()
                call(args.warmup + i)
                ends[i].record()
            torch.cuda.synchronize()
        us = sorted(1e3 * s.elapsed_time(e) for s, e in zip(starts, ends))
        if not args.no_backend:
            row["backend"] = detect_backend(lambda: call(0))
    except RuntimeError as ex:
        row.update(status="n/a", error=str(ex).splitlines()[0])
        return row
    finally:
        del sets
        torch.cuda.empty_cache()
    med = statistics.median(us)
    row.update(status="ok", median_us=f"{med:.3f}", min_us=f"{us[0]:.3f}", max_us=f"{us[-1]:.3f}",
               tb_s=f"{nbytes / (med * 1e-6) / 1e12:.4f}", error="")
    return row


def main():
    ap = argparse.ArgumentParser(description="SDPA on BF16 KV, one decode step, for bench/attn_decode's cases; "
                                             "CSV on stdout.")
    ap.add_argument("--shapes", type=parse_shapes, default=parse_shapes("qwen3-4b,qwen3-30b-a3b"),
                    help="qwen3-4b, qwen3-14b, qwen3-30b-a3b or Q:KV[:D] (default qwen3-4b,qwen3-30b-a3b)")
    ap.add_argument("--batches", type=parse_ints, default=parse_ints("1,4,16,64"), help="default 1,4,16,64")
    ap.add_argument("--contexts", type=parse_ints, default=parse_ints("4K,16K,32K,128K"),
                    help="tokens attended incl. the new one, K = 1024 (default 4K,16K,32K,128K)")
    ap.add_argument("--runs", type=int, default=30, help="timed calls per case, median reported (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls first (default 5)")
    ap.add_argument("--rotate-mb", type=float, default=256.0,
                    help="bytes read between two reads of the same data, at least 4 x L2 (default 256)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-backend", action="store_true", help="skip the profiler run that names the backend")
    args = ap.parse_args()
    if args.runs < 1 or args.warmup < 1:
        ap.error("--runs and --warmup must be at least 1")
    if args.runs < 20:
        print(f"sdpa_decode: note: --runs {args.runs} is below 20", file=sys.stderr)
    if not torch.cuda.is_available():
        print("sdpa_decode: no CUDA device", file=sys.stderr)
        return 1

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or 0
    rotate_bytes = max(4.0 * l2, args.rotate_mb * 1048576.0)
    gqa = gqa_mode(dev)
    cycles_per_ms = sleep_cycles_per_ms()

    print("# bench: sdpa_decode (torch.nn.functional.scaled_dot_product_attention, BF16 KV, one layer, q length 1)")
    print("# command: " + " ".join(sys.argv))
    print(f"# device: {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 1e9:.1f} GB, "
          f"L2 {l2 / 1048576:.1f} MB")
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    enabled = []
    for kind in ("flash", "mem_efficient", "math", "cudnn"):
        flag = getattr(torch.backends.cuda, f"{kind}_sdp_enabled", None)
        if flag is not None:
            enabled.append(f"{kind} {'on' if flag() else 'off'}")
    print(f"# torch: {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {cudnn}; SDPA backends enabled: "
          + (", ".join(enabled) or "unknown"))
    print(f"# gqa: {gqa}" + ("" if gqa == "enable_gqa" else " (KV materialized for every query head: SDPA reads "
                                                             "G x the KV bytes the bytes column counts)"))
    print(f"# l2: rotation over (q, k, v) copies, >= {rotate_bytes / 1048576:.0f} MB of other data read between "
          "two reads of a copy")
    print(f"# timing: CUDA events around each call, {args.warmup} warm-up calls, median of {args.runs}, "
          + ("calls enqueued ahead behind torch.cuda._sleep" if cycles_per_ms else
             "no torch.cuda._sleep: host launch gaps may show in small cases"))
    print(",".join(HEADER), flush=True)

    for shape in args.shapes:
        for ctx in args.contexts:
            for batch in args.batches:
                row = run_case(shape, batch, ctx, args, dev, gqa, cycles_per_ms, rotate_bytes)
                emit(row)
                if row.get("status") == "ok":
                    print(f"{shape[0]:<14} batch {batch:2d} ctx {ctx:6d} sdpa-bf16 {float(row['median_us']):10.2f} us "
                          f"{row['bytes'] / 1e6:8.1f} MB {float(row['tb_s']):6.2f} TB/s (copies {row['copies']}) "
                          f"{row.get('backend', '')}", file=sys.stderr)
                else:
                    print(f"{shape[0]:<14} batch {batch:2d} ctx {ctx:6d} sdpa-bf16 n/a: {row.get('error')}",
                          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
