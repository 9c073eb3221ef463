#!/usr/bin/env python3
"""A GRPO-style rollout loop over fp4rollout's HTTP API with plain aiohttp,
as a slime or verl user drives SGLang: a group of n samples per prompt from
/generate with their log-probs, a reward, a pause while the new weights go
in from disk, continue. docs/http.md.

    fp4rollout serve --model models/demo --http-port 8000 &
    examples/http/rollout_loop.py --url http://127.0.0.1:8000 --steps 2 [--weights models/demo]"""
import argparse
import asyncio

import aiohttp


async def generate(s, url, prompt, n):
    body = {"text": prompt, "return_logprob": True,
            "sampling_params": {"n": n, "temperature": 1.0, "max_new_tokens": 32, "stop": ["\n\n"]}}
    async with s.post(url + "/generate", json=body) as r:
        r.raise_for_status()
        return await r.json()


def reward(text):
    return float("self" in text)   # a stand-in for a verifier


async def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--weights", help="a folder of safetensors to load after each step")
    a = ap.parse_args()
    prompts = ["def ", "class ", "import "]
    async with aiohttp.ClientSession() as s:
        for step in range(a.steps):
            groups = await asyncio.gather(*[generate(s, a.url, p, a.group) for p in prompts])
            for p, samples in zip(prompts, groups):
                rs = [reward(x["text"]) for x in samples]
                mean = sum(rs) / len(rs)
                lps = [sum(e[0] for e in x["meta_info"]["output_token_logprobs"]) for x in samples]
                print(f"step {step} {p!r}: rewards {rs} advantages {[round(r - mean, 2) for r in rs]} "
                      f"seq log-probs {[round(v, 1) for v in lps]} weight version "
                      f"{samples[0]['meta_info']['weight_version']}")
            if a.weights:   # the trainer's step would write new weights here
                async with s.post(a.url + "/pause_generation", json={"mode": "wait"}) as r:
                    r.raise_for_status()
                async with s.post(a.url + "/update_weights_from_disk", json={"model_path": a.weights}) as r:
                    print("update:", await r.json())
                async with s.post(a.url + "/continue_generation") as r:
                    r.raise_for_status()


asyncio.run(main())
