"""Text through the server (run by serve_text.sh): prompts as text, the
server's text back (streamed deltas and each sample's whole text), stop
strings taken from a first run's own text (so they span tokens and arrive
across delta boundaries) ending the replayed samples where they first occur,
multi-byte characters, and the refusals. Arguments: the endpoint of a byte-level
model's server, of a server with Qwen3's tokenizer ("-" when
../shared/tokenizers/qwen3 is absent), of a server without a tokenizer, and
a file for the samples the shell compares with fp4rollout-client and the
command line.
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "trainer_bridge", "client", "python"))
from fp4rollout_client import ByteTokenizer, ClientError, RolloutClient, ServerError, TokenDelta  # noqa: E402

byte_ep, qwen_ep, bare_ep, out_path = sys.argv[1:5]
REPLACEMENT = "\ufffd"


def check(cond, what):
    if not cond:
        raise SystemExit(f"serve_text.py: {what}")


def stream(c, prompt, **kw):
    """(sample index -> SampleResult, sample index -> [delta, ...]) of one streamed request."""
    samples, deltas = {}, {}
    for e in c.generate_stream(prompt, **kw):
        if isinstance(e, TokenDelta):
            deltas.setdefault(e.sample, []).append(e)
        else:
            samples[e.sample] = e
    return samples, deltas


def check_stream(s, ds, what):
    """The deltas: contiguous tokens, text on every one, their texts joined a prefix of the sample's."""
    joined = "".join(d.text for d in ds)
    check(all(d.text is not None for d in ds), f"{what}: a delta without text")
    check([t for d in ds for t in d.token_ids] == s.token_ids, f"{what}: the deltas' tokens are not the sample's")
    check(s.text.startswith(joined), f"{what}: streamed {joined!r} is not a prefix of the text {s.text!r}")
    return joined


def pick_stop(text, start, chars=3):
    """A stop string from text: `chars` characters from index start on, with no U+FFFD nor NUL in them."""
    for i in range(start, len(text) - chars):
        piece = text[i:i + chars]
        if REPLACEMENT not in piece and "\0" not in piece:
            return piece
    return None


def replay_with_stop(c, prompt, ref, ref_deltas, stop, include, what, temperature=0.9):
    """The reference request again with a stop string from its text: cut at its first occurrence."""
    at = ref.text.index(stop)
    end = at + len(stop)
    samples, deltas = stream(c, prompt, n=1, max_tokens=len(ref.token_ids), temperature=temperature, seed=ref.seed,
                             stop=[stop, "never appears \u2603\u2603"], include_stop_str_in_output=include)
    s = samples[0]
    check(s.finish_reason == "stop" and s.stop_str == stop, f"{what}: ended {s.finish_reason} / {s.stop_str!r}")
    check(s.text == ref.text[:end if include else at], f"{what}: text {s.text!r}, want the text up to {stop!r}")
    k = len(s.token_ids)
    check(s.token_ids == ref.token_ids[:k] and s.logprobs == ref.logprobs[:k], f"{what}: not the first run's draws")
    joined = check_stream(s, deltas[0], what)
    check(include or stop not in joined, f"{what}: the stop string was streamed")
    # the token that completed it: the text of the tokens before it does not hold it
    before = len("".join(d.text for d in ref_deltas[0] if d.start + len(d.token_ids) < k))
    check(stop not in ref.text[:before], f"{what}: the stop string was complete before its last token")
    return s, deltas[0]


def byte_level_server():
    with RolloutClient(byte_ep) as c:
        hello = c.hello()
        check(hello["tokenizer"] == "byte-level", f"hello's tokenizer is {hello['tokenizer']!r}")
        prompt = "def __init__(self"
        ref_samples, ref_deltas = stream(c, prompt, n=1, max_tokens=64, temperature=0.9, seed=7)
        ref = ref_samples[0]
        check(c.tokenizer is None, "the client chose a tokenizer of its own instead of the server's")
        check(ref.prompt_token_ids == ByteTokenizer().encode(prompt), f"prompt ids {ref.prompt_token_ids}")
        check(ref.text == ByteTokenizer().decode(ref.token_ids), "the text is not the tokens decoded")
        check_stream(ref, ref_deltas[0], "byte-level reference")
        stop = pick_stop(ref.text, len(ref.text) // 3)
        check(stop is not None, f"no stop string to take from {ref.text!r}")
        s, ds = replay_with_stop(c, prompt, ref, ref_deltas, stop, False, "byte-level stop")
        replay_with_stop(c, prompt, ref, ref_deltas, stop, True, "byte-level stop included")
        # the stop string's tokens came in more than one delta: it spans a delta boundary
        end_tok = len(s.token_ids)
        spanned = [d for d in ds if d.start + len(d.token_ids) > end_tok - len(stop.encode())]
        check(len(spanned) >= 2, f"the stop string's tokens came in {len(spanned)} delta(s)")
        # several stop strings and n samples: each sample's own first match
        many = list(c.generate(prompt, n=3, max_tokens=64, temperature=0.9, seed=7, stop=[stop, "\n\n", "):"]))
        check(len(many) == 3 and all(m.finish_reason in ("stop", "length") for m in many), "n = 3 with stops")
        for m in many:
            check(m.stop_str is None or m.text + m.stop_str in ByteTokenizer().decode(m.token_ids),
                  f"sample {m.sample}: {m.text!r} and {m.stop_str!r} are not its tokens' text")
        # ids in, text out once the client knows the server's tokenizer
        (r,) = c.generate([256, 100, 101, 102], max_tokens=8, temperature=0, return_text=True)
        check(r.text == ByteTokenizer().decode(r.token_ids) and r.prompt_token_ids is None, "ids in, text out")
        json.dump([ref.__dict__, s.__dict__], open(out_path, "w"))
    # a client with a tokenizer of its own keeps decoding itself
    with RolloutClient(byte_ep, tokenizer="byte") as c:
        (r,) = c.generate("def ", max_tokens=8, temperature=0)
        check(r.text == ByteTokenizer().decode(r.token_ids) and r.prompt_token_ids is None, "client-side text")


def qwen3_server():
    if qwen_ep == "-":
        print("serve_text.py: SKIP the Qwen3 tokenizer checks: ../shared/tokenizers/qwen3 is absent")
        return
    with RolloutClient(qwen_ep) as c:
        prompt = "Réponds en français: 你好, 世界 ✅"
        ref_samples, ref_deltas = stream(c, prompt, n=2, max_tokens=48, temperature=1.0, seed=3)
        check(ref_samples[0].prompt_token_ids[0] != 151643 and len(ref_samples[0].prompt_token_ids) > 5,
              f"Qwen3 prompt ids {ref_samples[0].prompt_token_ids}")
        for k, ref in ref_samples.items():
            check_stream(ref, ref_deltas[k], f"qwen3 sample {k}")
        # the replays run alone: the reference too (batches of other sizes may round differently)
        ref_samples, ref_deltas = stream(c, prompt, n=1, max_tokens=48, temperature=1.0, seed=3)
        ref = ref_samples[0]
        multi = [ch for ch in ref.text[len(ref.text) // 4:] if ord(ch) > 0x7FF and ch != REPLACEMENT]
        check(multi, f"no character of 3 or more bytes in {ref.text!r}")
        replay_with_stop(c, prompt, ref, ref_deltas, multi[0], False, "qwen3 multi-byte stop", 1.0)
        stop = pick_stop(ref.text, len(ref.text) // 2, 4)
        check(stop is not None, f"no stop string to take from {ref.text!r}")
        replay_with_stop(c, prompt, ref, ref_deltas, stop, True, "qwen3 stop included", 1.0)


def bare_server():
    with RolloutClient(bare_ep) as c:
        check(c.hello()["tokenizer"] is None, "a server without a tokenizer announces one")
        try:
            list(c.generate("hello", max_tokens=4))
            check(False, "a text prompt went through a server without a tokenizer")
        except ClientError as e:
            check("neither the server nor this client has a tokenizer" in str(e), f"text refused with: {e}")
        try:
            list(c.generate([1, 2, 3], max_tokens=4, stop=["\n"]))
            check(False, "stop strings went through a server without a tokenizer")
        except ServerError as e:
            check(e.code == "invalid_request" and "stop needs the server's tokenizer" in e.message, str(e))
    with RolloutClient(bare_ep, tokenizer="server") as c:
        try:
            list(c.generate("hello", max_tokens=4))
            check(False, "prompt_text went through a server without a tokenizer")
        except ServerError as e:
            check(e.code == "invalid_request" and "prompt_text needs the server's tokenizer" in e.message, str(e))


byte_level_server()
qwen3_server()
bare_server()
print("serve_text.py: all checks passed")
