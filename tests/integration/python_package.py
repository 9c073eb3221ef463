"""Checks of the installed fp4rollout_client package against a live server
(synthetic:tiny, a byte-level vocabulary, max_seqs 4, every sample
monitored). Run by python_package.sh from outside the tree."""
import asyncio
import os
import re
import sys

import fp4rollout_client as fc

endpoint, dead = sys.argv[1], sys.argv[2]


def check(ok, what):
    if not ok:
        raise SystemExit(f"python_package: {what}")


here = os.path.dirname(os.path.abspath(fc.__file__))
check("site-packages" in here, f"the package was not imported from the environment: {here}")
check(os.path.dirname(fc._native._find_library()) == here, "the library is not the packaged copy")

with fc.RolloutClient(endpoint) as c:
    # Text: through the server's tokenizer (a byte-level model's built-in one), no client tokenizer needed.
    text = list(c.generate("hello", n=2, max_tokens=8, seed=5, temperature=0.9))
    check(c.tokenizer is None, "the client chose a tokenizer of its own over the server's")
    check(all(s.prompt_token_ids == [256] + list(b"hello") for s in text), "the server's ids of the text prompt")
    check(text[0].request_id == 0, f"the first request id is {text[0].request_id}, not 0")
    ids = [256] + list(b"hello")
    by_ids = {s.sample: s.token_ids for s in c.generate(ids, n=2, max_tokens=8, seed=5, temperature=0.9)}
    for s in text:
        check(s.token_ids == by_ids[s.sample], "text and its ids gave different samples")
        check(s.text == fc.ByteTokenizer().decode(s.token_ids), "sample text is not its tokens decoded")
        check(s.divergence["kl_mean"] is not None, "a monitored sample has no KL")

    # Prompts of every integer kind give the same tokens.
    import numpy as np
    kinds = {"tuple": tuple(ids), "numpy": np.array(ids, dtype=np.int64), "np.int32 list": [np.int32(i) for i in ids]}
    try:
        import torch
        kinds["torch"] = torch.tensor(ids, dtype=torch.int32)
    except ImportError:
        pass
    for kind, p in kinds.items():
        got = {s.sample: s.token_ids for s in c.generate(p, n=2, max_tokens=8, seed=5, temperature=0.9)}
        check(got == by_ids, f"a {kind} prompt gave other tokens")
    batch = list(c.generate([np.array(ids), "hello"], max_tokens=4, seed=1))
    check(len(batch) == 2 and len({s.request_id for s in batch}) == 2, "a batch of two prompts")
    rows = list(c.generate(np.array([ids, ids]), max_tokens=4, seed=1))
    check(len(rows) == 2 and rows[0].token_ids == rows[1].token_ids, "a 2-D array is a batch of its rows")

    for bad, why in (([], "an empty batch"), ([1.5, 2], "floats"), ([[]], "an empty prompt"),
                     (np.array([1.0, 2.0]), "a float array")):
        try:
            c.generate(bad, max_tokens=2)
            check(False, f"{why} was accepted")
        except fc.ClientError:
            pass

    # A GRPO group larger than the engine's max_seqs (4) is queued, not refused.
    group = list(c.generate(ids, n=6, max_tokens=6, seed=3, temperature=1.0))
    check(sorted(s.sample for s in group) == list(range(6)), "n = 6 on max_seqs 4: not 6 samples")
    check(all(s.divergence["kl_mean"] is not None for s in group), "a queued sample lost its monitoring")
    check(len({tuple(s.token_ids) for s in group}) > 1, "the queued samples are all alike")

    # A stand-in tokenizer with the Hugging Face interface (upper-cases text).
    class Upper:
        def encode(self, t):
            return [256] + list(t.upper().encode())

        def decode(self, ids):
            return "".join(chr(i) for i in ids if i < 256).lower()

    with fc.RolloutClient(endpoint, tokenizer=Upper()) as u:
        s = next(iter(u.generate("hi", max_tokens=4, seed=2)))
        ref = next(iter(c.generate([256] + list(b"HI"), max_tokens=4, seed=2)))
        check(s.token_ids == ref.token_ids, "the given tokenizer was not used to encode")
        check(s.text == Upper().decode(s.token_ids), "the given tokenizer was not used to decode")

    # One request id everywhere: a refusal names the caller's id once.
    c.submit([256, 300], max_tokens=4, request_id=77)
    try:
        list(c.results())
        check(False, "an id outside the vocabulary was accepted")
    except fc.ServerError as e:
        check(e.request_id == 77 and "77" in str(e), f"the error does not carry the caller's id: {e}")
        named = re.findall(r"request[_ ]?(?:id)? (\d+)", str(e))
        check(named == ["77"], f"the message names requests {named}, not once the caller's 77: {e}")


# The asyncio API gives what the blocking one gives.
async def run_async():
    async with fc.AsyncRolloutClient(endpoint) as a:
        hello = await a.hello()
        check(hello["vocab_size"] == 272, "async hello")
        got = await a.generate("hello", n=2, max_tokens=8, seed=5, temperature=0.9)
        return {s.sample: s.token_ids for s in got}


check(asyncio.run(run_async()) == by_ids, "the asyncio client gave other samples")

# A dead endpoint: a connection error that names it.
try:
    fc.RolloutClient(dead, timeout_ms=300).hello()
    check(False, "a dead endpoint answered")
except fc.ConnectError as e:
    check(dead in str(e) and isinstance(e, ConnectionError), f"the error does not name the endpoint: {e}")
print("python_package.py: all checks passed")
