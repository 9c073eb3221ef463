"""The HTTP API of `fp4rollout serve` (docs/http.md), driven with aiohttp:
greedy /generate and /v1/completions against `fp4rollout generate`'s ids and
text, streams reassembled, 2,000 concurrent streams each ending once while
/health answers, abort, pause modes, weights from disk, memory release and
resume, penalties equal to the ZeroMQ client's, and refused bodies; text
and stop strings (the engine's) equal to the ZeroMQ client's with the
server's tokenizer, streamed without the stop string.

Usage: serve_http.py HTTP_URL ZMQ_ENDPOINT REFERENCE_JSONL WORK_DIR MODEL_DIR
       serve_http.py HTTP_URL ZMQ_ENDPOINT --text   (the text checks alone)"""
import asyncio
import json
import os
import struct
import sys
import time

import aiohttp

url, zmq_ep = sys.argv[1:3]
TEXT_ONLY = sys.argv[3] == "--text"
if not TEXT_ONLY:
    ref_path, work, model_dir = sys.argv[3:6]
    REF = json.loads(open(ref_path).readline())   # fp4rollout generate --prompt "def " --greedy --json


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_http: {what}")


async def post(s, path, body=None, data=None):
    async with s.post(url + path, json=body if data is None else None, data=data) as r:
        return r.status, await r.json(content_type=None)


async def get(s, path):
    async with s.get(url + path) as r:
        return r.status, await r.text()


async def sse(s, path, body):
    """The events of a stream, parsed, up to data: [DONE] (which must come)."""
    events, done = [], False
    async with s.post(url + path, json=body) as r:
        check(r.status == 200, f"{path} stream: status {r.status}")
        check(r.headers["Content-Type"].startswith("text/event-stream"), "a stream is text/event-stream")
        async for line in r.content:
            line = line.decode().strip()
            if not line:
                continue
            check(line.startswith("data: "), f"an SSE line: {line[:80]}")
            if line == "data: [DONE]":
                done = True
                continue
            check(not done, "nothing after [DONE]")
            events.append(json.loads(line[6:]))
    check(done, f"{path}: the stream ends with data: [DONE]")
    return events


async def greedy(s):
    n = len(REF["token_ids"])
    st, g = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    check(st == 200, f"/generate: {st} {g}")
    check(g["output_ids"] == REF["token_ids"], f"/generate ids {g['output_ids']} != generate's {REF['token_ids']}")
    text = bytes(t for t in REF["token_ids"] if t < 256).decode("utf-8", "replace")
    check(g["text"] == text, f"/generate text {g['text']!r} != {text!r}")
    check(g["meta_info"]["prompt_tokens"] == 5 and g["meta_info"]["completion_tokens"] == n, "token counts")
    check(g["meta_info"]["finish_reason"] == {"type": "length", "length": n}, "finish_reason length")
    st, g2 = await post(s, "/generate", {"input_ids": [256] + list(b"def "), "return_logprob": True,
                                         "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    check(g2["output_ids"] == REF["token_ids"], "input_ids give the same tokens as text")
    lps = [e[0] for e in g2["meta_info"]["output_token_logprobs"]]
    check(all(abs(a - b) < 1e-5 for a, b in zip(lps, REF["logprobs"])), "log-probs equal generate's")
    st, c = await post(s, "/v1/completions", {"model": "m", "prompt": "def ", "max_tokens": n, "temperature": 0,
                                              "logprobs": 2})
    check(st == 200 and c["object"] == "text_completion", f"/v1/completions: {st} {c}")
    ch = c["choices"][0]
    check(ch["token_ids"] == REF["token_ids"] and ch["text"] == text, "/v1/completions equals generate")
    check(len(ch["logprobs"]["top_logprobs"]) == n, "top log-probs per token")
    check(c["usage"] == {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}, f"usage {c['usage']}")
    st, c = await post(s, "/v1/completions", {"prompt": [[256, 100, 101, 102, 32]], "max_tokens": 4,
                                              "temperature": 0, "echo": True})
    check(c["choices"][0]["text"].startswith("def "), "echo puts the prompt first")
    # streams reassemble to the same tokens and text
    ev = await sse(s, "/generate", {"text": "def ", "stream": True,
                                    "sampling_params": {"max_new_tokens": n, "temperature": 0}})
    check(ev[-1]["output_ids"] == REF["token_ids"] and ev[-1]["text"] == text, "an SGLang stream's last chunk")
    ev = await sse(s, "/v1/completions", {"prompt": "def ", "max_tokens": n, "temperature": 0, "stream": True,
                                          "stream_options": {"include_usage": True}})
    ids = [t for e in ev for c in e["choices"] for t in c["token_ids"]]
    check(ids == REF["token_ids"], f"an OpenAI stream's deltas {ids}")
    check("".join(c["text"] for e in ev for c in e["choices"]) == text, "an OpenAI stream's text")
    check(ev[-1]["usage"]["completion_tokens"] == n, "the usage chunk")
    # n samples of a batch, and a stop string
    st, b = await post(s, "/generate", {"text": ["def ", "class "], "sampling_params": {
        "max_new_tokens": 6, "temperature": 0.9, "n": 2, "seed": 7}})
    check(st == 200 and len(b) == 4, "a batch of 2 prompts x n 2 is a list of 4")
    st, g = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                           "stop": ["ni"]}})
    check(g["text"] == text[:text.index("ni")], f"the text stops before the stop string: {g['text']!r}")
    check(g["meta_info"]["finish_reason"] == {"type": "stop", "matched": "ni"}, "finish_reason matched")


async def one_stream(s, i, seen):
    ev = await sse(s, "/generate", {"input_ids": [256, 100 + i % 50], "stream": True, "rid": f"c{i}",
                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    last = ev[-1]
    check(last["meta_info"]["finish_reason"] is not None and len(last["output_ids"]) == 3, f"stream {i} ended")
    seen.append(last["meta_info"]["id"])


async def concurrent(s, n):
    """n streams at once; /health answers while they run."""
    seen, health = [], []

    async def watch():
        while len(seen) < n:
            t0 = time.monotonic()
            st, _ = await get(s, "/health")
            health.append((st, time.monotonic() - t0))
            await asyncio.sleep(0.2)

    t0 = time.monotonic()
    await asyncio.gather(watch(), *[one_stream(s, i, seen) for i in range(n)])
    check(sorted(seen) == sorted(f"c{i}" for i in range(n)), "every stream ended exactly once")
    check(len(health) >= 1 and all(st == 200 for st, _ in health), f"/health answered: {health[:5]}")
    check(max(d for _, d in health) < 10, "/health answered within 10 s while the streams ran")
    print(f"serve_http: {n} concurrent streams in {time.monotonic() - t0:.1f} s, /health {len(health)} times, "
          f"slowest {max(d for _, d in health):.2f} s")


async def aborts_and_pauses(s):
    long = {"input_ids": [256, 100], "sampling_params": {"max_new_tokens": 3000, "temperature": 0.8,
                                                         "ignore_eos": True}}
    task = asyncio.ensure_future(post(s, "/generate", dict(long, rid="long")))
    await asyncio.sleep(0.5)
    st, r = await post(s, "/abort_request", {"rid": "long"})
    check(st == 200 and r["aborted_samples"] == 1, f"/abort_request: {st} {r}")
    st, g = await task
    check(g["meta_info"]["finish_reason"]["type"] == "abort", f"the aborted request: {g['meta_info']}")
    # pause with mode abort ends what runs; requests during the pause wait for continue
    task = asyncio.ensure_future(post(s, "/generate", long))
    await asyncio.sleep(0.5)
    st, p = await post(s, "/pause_generation", {"mode": "abort"})
    check(st == 200 and p["aborted_samples"] == 1, f"pause abort: {p}")
    st, g = await task
    check(g["meta_info"]["finish_reason"]["type"] == "abort", "pause abort ended it")
    await asyncio.sleep(0.5)
    st, _ = await get(s, "/health")
    check(st == 503, f"/health while paused: {st}")
    held = asyncio.ensure_future(post(s, "/generate", {"input_ids": [256, 100], "sampling_params": {
        "max_new_tokens": 2}}))
    await asyncio.sleep(0.3)
    check(not held.done(), "a request during a pause is held")
    st, r = await post(s, "/continue_generation", {})
    check(st == 200 and r["released_requests"] == 1, f"continue: {r}")
    st, g = await held
    check(st == 200 and len(g["output_ids"]) == 2, "the held request ran after continue")
    # mode wait: the running request finishes, then paused
    task = asyncio.ensure_future(post(s, "/generate", {"input_ids": [256, 100], "sampling_params": {
        "max_new_tokens": 64, "ignore_eos": True}}))
    await asyncio.sleep(0.2)
    st, p = await post(s, "/pause_generation", {"mode": "wait"})
    check(st == 200 and p["aborted_samples"] == 0, f"pause wait: {p}")
    st, g = await task
    check(g["meta_info"]["finish_reason"]["type"] == "length", "pause wait let it finish")
    await post(s, "/continue_generation", {})
    await keep_pauses(s)


async def keep_pauses(s):
    """keep (SGLang's in_place) freezes a running sample until continue, which it then finishes as if never
    paused; retract (keep with recompute) frees its KV cache and recomputes it at continue."""
    body = {"input_ids": [256, 100], "sampling_params": {"max_new_tokens": 1500, "temperature": 0,
                                                         "ignore_eos": True}}
    st, ref = await post(s, "/generate", body)
    for mode in ("keep", "in_place", "retract"):
        task = asyncio.ensure_future(post(s, "/generate", body))
        await asyncio.sleep(0.3)
        st, p = await post(s, "/pause_generation", {"mode": mode})
        check(st == 200 and p["aborted_samples"] == 0, f"pause {mode}: {st} {p}")
        await asyncio.sleep(0.5)
        check(not task.done(), f"pause {mode} froze the running request")
        st, info = await get(s, "/get_server_info")
        check(json.loads(info)["state"] == "paused", f"paused ({mode}): {info}")
        st, r = await post(s, "/continue_generation", {"recompute": mode == "keep"})
        check(st == 200, f"continue after {mode}: {r}")
        st, g = await task
        check(g["meta_info"]["finish_reason"]["type"] == "length" and len(g["output_ids"]) == 1500,
              f"the frozen request finished after {mode}: {g['meta_info']}")
        if mode == "in_place":   # same weights, same KV cache: the greedy tokens of an unpaused run
            check(g["output_ids"] == ref["output_ids"], "a keep pause changes no token")
    st, r = await post(s, "/pause_generation", {"mode": "wait", "recompute": True})
    check(st == 400 and "recompute" in r["error"]["message"], f"recompute with wait: {r}")
    st, r = await post(s, "/pause_generation", {"mode": "freeze"})
    check(st == 400 and "keep" in r["error"]["message"], f"an unknown mode: {r}")


async def text_and_stops(s):
    """Text is the engine's: HTTP answers equal the ZeroMQ client's with the server's tokenizer (tokens, text,
    stop string); a stop string from a first run's text cuts the replay where it first occurs, streams never
    show it, and SGLang's no_stop_trim and vLLM's include_stop_str_in_output keep it."""
    from fp4rollout_client import RolloutClient
    prompt = "Grüße aus 東京: def f(x):"
    sp = {"max_new_tokens": 40, "temperature": 0.9, "seed": 5, "ignore_eos": True}
    st, ref = await post(s, "/generate", {"text": prompt, "sampling_params": sp})
    check(st == 200, f"a text prompt: {ref}")
    text = ref["text"]
    with RolloutClient(zmq_ep, tokenizer="server") as c:
        z = list(c.generate(prompt, max_tokens=40, temperature=0.9, seed=5, stop_token_ids=[]))[0]
    check(z.token_ids == ref["output_ids"] and z.text == text, f"HTTP {text!r} != ZeroMQ {z.text!r}")
    check(ref["meta_info"]["prompt_tokens"] == len(z.prompt_token_ids), "the prompt as the server encodes it")
    stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text) - 3) if "\ufffd" not in text[i:i + 3])
    cut = text[:text.index(stop)]
    st, g = await post(s, "/generate", {"text": prompt, "sampling_params": dict(sp, stop=[stop])})
    check(g["text"] == cut and g["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop},
          f"the stop string {stop!r}: {g['text']!r}, {g['meta_info']['finish_reason']}")
    ids = g["output_ids"]
    check(ids == ref["output_ids"][:len(ids)], "a stop string changes no draw")
    with RolloutClient(zmq_ep, tokenizer="server") as c:
        z = list(c.generate(prompt, max_tokens=40, temperature=0.9, seed=5, stop_token_ids=[], stop=[stop]))[0]
    check(z.token_ids == ids and z.text == cut and z.stop_str == stop, "the ZeroMQ client's stopped sample")
    st, g = await post(s, "/generate", {"text": prompt, "sampling_params": dict(sp, stop=stop, no_stop_trim=True)})
    check(g["text"] == cut + stop, f"no_stop_trim keeps it: {g['text']!r}")
    ev = await sse(s, "/generate", {"text": prompt, "stream": True, "sampling_params": dict(sp, stop=[stop])})
    check(all(cut.startswith(e["text"]) for e in ev) and ev[-1]["text"] == cut, "an SGLang stream with a stop")
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0.9, "seed": 5, "ignore_eos": True, "stop": stop}
    ev = await sse(s, "/v1/completions", dict(body, stream=True))
    ch = [c for e in ev for c in e["choices"]]
    check("".join(c["text"] for c in ch) == cut and [t for c in ch for t in c["token_ids"]] == ids,
          "an OpenAI stream with a stop string")
    check(ch[-1]["finish_reason"] == "stop" and ch[-1]["stop_reason"] == stop and ch[-1]["matched_stop"] == stop,
          f"its last chunk: {ch[-1]}")
    st, c = await post(s, "/v1/completions", dict(body, include_stop_str_in_output=True))
    check(c["choices"][0]["text"] == cut + stop, "include_stop_str_in_output keeps it")


def write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, (shape, values) in tensors.items():
        raw = struct.pack(f"<{len(values)}f", *values)
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


async def weights_and_memory(s):
    st, info = await get(s, "/get_model_info")
    v0 = int(json.loads(info)["weight_version"])
    st, r = await post(s, "/update_weights_from_disk", {"model_path": model_dir})
    check(st == 200 and r["success"] and int(r["weight_version"]) == v0 + 1, f"update from disk: {st} {r}")
    st, r = await post(s, "/update_weights_from_disk", {"model_path": "/nonexistent/folder"})
    check(st == 400 and not r["success"] and "cannot open" in r["message"], f"a bad path: {r}")
    bad = os.path.join(work, "bad")
    os.makedirs(bad, exist_ok=True)
    write_safetensors(os.path.join(bad, "model.safetensors"), {"model.norm.weight": ([3], [1.0, 1.0, 1.0])})
    st, r = await post(s, "/update_weights_from_disk", {"model_path": bad, "weight_version": v0 + 5})
    check(st == 400 and r["code"] == "bad_shape" and "model.norm.weight" in r["message"], f"a bad shape: {r}")
    st, info = await get(s, "/get_model_info")
    check(int(json.loads(info)["weight_version"]) == v0 + 1, "a refused update changes nothing")
    st, g = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    check(g["meta_info"]["weight_versions"] == [v0 + 1] * 4, "tokens carry the new version")
    check(g["output_ids"] == REF["token_ids"][:4], "the same weights from disk give the same tokens")
    # memory
    st, r = await post(s, "/release_memory_occupation", {})
    check(st == 200 and r["success"], f"release: {r}")
    st, r = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": 4}})
    check(st == 503, f"generate while released: {st} {r}")
    st, _ = await get(s, "/health_generate")
    check(st == 503, "health_generate while released")
    st, r = await post(s, "/resume_memory_occupation", {})
    check(st == 200 and r["success"], f"resume: {r}")
    st, g = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    check(st == 200 and g["output_ids"] == REF["token_ids"][:4], "after resume the same tokens")
    st, body = await get(s, "/health_generate")
    check(st == 200, f"health_generate: {st} {body}")
    st, r = await post(s, "/flush_cache", {})
    check(st == 200, f"flush_cache when idle: {r}")


async def penalties(s):
    """The same seed and penalties over HTTP and through the ZeroMQ Python client give the same tokens."""
    sp = {"max_new_tokens": 24, "temperature": 0.9, "seed": 11, "min_p": 0.05, "presence_penalty": 0.7,
          "frequency_penalty": 0.3, "repetition_penalty": 1.3, "ignore_eos": True}
    st, g = await post(s, "/generate", {"input_ids": [256] + list(b"def "), "sampling_params": sp})
    check(st == 200, f"penalties: {g}")
    from fp4rollout_client import RolloutClient
    with RolloutClient(zmq_ep) as c:
        out = list(c.generate([256] + list(b"def "), max_tokens=24, temperature=0.9, seed=11, min_p=0.05,
                              presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.3,
                              stop_token_ids=[]))
    check(out[0].token_ids == g["output_ids"], f"HTTP {g['output_ids']} != ZeroMQ {out[0].token_ids}")
    st, plain = await post(s, "/generate", {"input_ids": [256] + list(b"def "), "sampling_params": dict(
        sp, min_p=0, presence_penalty=0, frequency_penalty=0, repetition_penalty=1)})
    check(plain["output_ids"] != g["output_ids"], "the penalties change the draws")


async def refusals(s):
    st, r = await post(s, "/generate", data=b"{not json")
    check(st == 400 and "JSON" in r["error"]["message"], f"not JSON: {r}")
    st, r = await post(s, "/generate", {"text": "x", "sampling_params": {"temperature": -1}})
    check(st == 400 and "sampling_params.temperature" in r["error"]["message"], f"a bad field: {r}")
    st, r = await post(s, "/generate", {"input_ids": [256, 9999]})
    check(st == 400 and "vocabulary" in r["error"]["message"], f"an id outside the vocabulary: {r}")
    st, r = await post(s, "/v1/completions", {"prompt": "x", "max_tokens": 0})
    check(st == 400 and "max_tokens" in r["error"]["message"], f"max_tokens 0: {r}")
    st, r = await post(s, "/generate", data=b'{"text": "' + b"a" * 70000 + b'"}')
    check(st == 413, f"an oversized body: {st}")
    st, r = await post(s, "/nope", {})
    check(st == 404, "an unknown endpoint")
    st, g = await post(s, "/generate", {"text": "def ", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
    check(g["output_ids"] == REF["token_ids"][:4], "refusals changed nothing")
    st, m = await get(s, "/v1/models")
    check(st == 200 and json.loads(m)["data"][0]["object"] == "model", "/v1/models")
    st, m = await get(s, "/metrics")
    check(st == 200 and "fp4rollout" in m, "/metrics on the same port")


async def main():
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        await text_and_stops(s)
        if TEXT_ONLY:
            print("serve_http.py --text: ok")
            return
        await greedy(s)
        await refusals(s)
        await aborts_and_pauses(s)
        await penalties(s)
        await weights_and_memory(s)
        await concurrent(s, int(os.environ.get("FR_HTTP_STREAMS", "2000")))
    print("serve_http.py: ok")


asyncio.run(main())
