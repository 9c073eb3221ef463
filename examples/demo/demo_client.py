#!/usr/bin/env python3
"""The trainer's side of `make demo`: a few text prompts, n = 4 samples each,
sampled by `fp4rollout serve` with an NVFP4 KV cache while every sample also
runs a BF16-KV shadow; prints each completion as text, its per-token
log-probs and its KL against BF16 KV, then a one-line summary.

    python3 examples/demo/demo_client.py --endpoint tcp://127.0.0.1:5555
"""
import argparse
import asyncio
import time
import urllib.request

from fp4rollout_client import AsyncRolloutClient, ByteTokenizer

PROMPTS = ["def ", "import os\nimport sys\n\n\ndef main(", "class Config:\n    def __init__(self"]


def show(text: str, width: int) -> str:
    """One line of a completion: newlines and tabs made visible, cut to width."""
    out = text.replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
    return out if len(out) <= width else out[:width - 3] + "..."


def print_sample(s, tok) -> None:
    """s.text is the server's (its tokenizer decodes); tok spells out single tokens for the log-prob line."""
    d = s.divergence
    kl = "not monitored" if d["kl_mean"] is None else f"KL {d['kl_mean']:.1e}, top-1 {100 * d['top1_agreement']:.0f}%"
    print(f"  [{s.request_id}.{s.sample}] {kl}: {show(s.text, 80)}")
    pieces = [f"{show(tok.decode([t]) or '<' + str(t) + '>', 8)}:{lp:.2f}" for t, lp in zip(s.token_ids, s.logprobs)]
    print("        log-probs: " + " ".join(pieces[:10]) + (" ..." if len(pieces) > 10 else ""))


async def run(a) -> int:
    t0 = time.monotonic()
    async with AsyncRolloutClient(a.endpoint, timeout_ms=60000) as c:
        hello = await c.hello("make demo")
        print(f"demo: {a.endpoint} serves {hello['model'].split('/')[-1]} on the {hello['backend'].upper()} "
              f"backend, KV cache {hello['kv_dtype'].upper()}; every sample also runs a BF16-KV shadow (KL per token in nats)")
        samples, tokens, shown = [], 0, set()
        async for s in c.stream(PROMPTS, n=4, max_tokens=a.max_tokens, temperature=0.8, top_p=0.95, seed=a.seed,
                                monitor=True):
            if s.request_id not in shown:
                shown.add(s.request_id)
                print(f"prompt {s.request_id}: \"{show(PROMPTS[s.request_id], 60)}\", n = 4, temperature 0.8")
            print_sample(s, ByteTokenizer())   # the demo model is byte-level: one token, one byte
            samples.append(s)
            tokens += len(s.token_ids)
        secs = time.monotonic() - t0
        kls = [s.divergence["kl_mean"] for s in samples if s.divergence["kl_mean"] is not None]
        agree = [s.divergence["top1_agreement"] for s in samples if s.divergence["top1_agreement"] is not None]
        if a.dashboard:
            with urllib.request.urlopen(a.dashboard, timeout=10) as page:   # the dashboard serves
                print(f"demo: dashboard {a.dashboard} (HTTP {page.status} while the server runs)")
        if len(samples) != 4 * len(PROMPTS) or len(kls) != len(samples):
            print(f"demo: FAILED: {len(samples)} samples, {len(kls)} with a KL")
            return 1
        print(f"demo: {len(PROMPTS)} prompts x 4 samples, {tokens} tokens in {secs:.1f} s "
              f"({tokens / secs:.0f} tokens/s); NVFP4 KV vs BF16 KV: mean KL {sum(kls) / len(kls):.2e} nats/token, "
              f"top-1 agreement {100 * sum(agree) / len(agree):.1f}%")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--endpoint", default="tcp://127.0.0.1:5555")
    ap.add_argument("--dashboard", help="the dashboard's URL, printed with the summary")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=1)
    return asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    raise SystemExit(main())
