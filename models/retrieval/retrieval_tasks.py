#!/usr/bin/env python3
"""Synthetic long-context retrieval tasks for byte-level models (RULER-like).

Three variants, each a prompt that ends in "Answer: " and an answer of one
line that follows it:

- single: many records `key K = value V` (K eight characters of A-Z0-9, V
  six of a-z0-9, every key distinct), then a question for one key whose
  record sits anywhere in the prompt (depth uniform over the records).
- multikey: the same records, then a question for several keys (four by
  default) at independent depths; the answer is their values in the order
  asked, joined by ", ".
- vartrack: variable tracking: a chain `VAR X1 = 12345`, `VAR X2 = X1`,
  ..., `VAR Xh = X(h-1)` (names of five letters A-Z, the value five digits)
  spread in order among the records, beside distractor chains of the same
  form; the question asks for the value of the chain's last variable.

The prompt's length in bytes (the model's tokens, BOS aside) is the target
context minus at most one record's length: records are added while the
whole still fits. Everything follows from (seed, split, variant, context,
index) through Python's own `random.Random`, seeded with that tuple as a
string (its SHA-512 seeding gives the same stream on every platform and
Python 3 version): the same arguments write the same file, and the splits
`train` and `heldout` draw independent streams, so a held-out prompt is not
a training one.

    python3 models/retrieval/retrieval_tasks.py --split heldout --seed 1 \\
        --contexts 4096,8192,16384 --n 500 --out heldout.jsonl

writes one JSON object a line: {"prompt", "answer", "variant", "context",
"depth", "split", "seed", "index"}; `fp4rollout eval-task --tasks` reads the
first four (docs/eval_task.md). The standard library is enough: the
training script (train_retrieval.py) imports this module for its batches.
"""
import argparse
import json
import random
import sys

VARIANTS = ("single", "multikey", "vartrack")
KEY_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
VALUE_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"
VAR_CHARS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
HEADER = "Below are records. Read them, then answer the question.\n"
BOS, EOS, PAD = 256, 257, 258


def rng_for(seed, split, variant, context, index):
    return random.Random("%d:%s:%s:%d:%d" % (seed, split, variant, context, index))


def fresh(rng, chars, n, used):
    while True:
        s = "".join(rng.choice(chars) for _ in range(n))
        if s not in used:
            used.add(s)
            return s


def record(key, value):
    return "key %s = value %s\n" % (key, value)


def fill_records(rng, budget, used):
    """(key, value) records whose lines fit in budget bytes."""
    out, size = [], 0
    line_len = len(record("K" * 8, "v" * 6))
    while size + line_len <= budget:
        out.append((fresh(rng, KEY_CHARS, 8, used), fresh(rng, VALUE_CHARS, 6, set())))
        size += line_len
    return out


def single_question(key):
    return "Question: what is the value of key %s?\nAnswer: " % key


def kv_task(rng, context, n_queries, drills=0):
    """A prompt of records and its final question. drills (training only): that
    many answered single-key questions on random records between the records
    and the final question, each answer a supervised span (their byte ranges in
    the prompt); 0 draws nothing more from rng, so prompts without drills are
    the same as ever."""
    if n_queries == 1:
        question = single_question("K" * 8)
    else:
        question = "Question: what are the values of keys %s, in this order?\nAnswer: " % ", ".join(
            ["K" * 8] * n_queries)
    drill_bytes = drills * len(single_question("K" * 8) + "v" * 6 + "\n")
    records = fill_records(rng, context - len(HEADER) - len(question) - drill_bytes, set())
    if len(records) < n_queries:
        raise ValueError("context %d is too short for %d queries%s" % (
            context, n_queries, " and %d drills" % drills if drills else ""))
    asked = rng.sample(range(len(records)), n_queries)
    keys = [records[i][0] for i in asked]
    if n_queries == 1:
        question = single_question(keys[0])
    else:
        question = "Question: what are the values of keys %s, in this order?\nAnswer: " % ", ".join(keys)
    prompt = HEADER + "".join(record(k, v) for k, v in records)
    spans = []
    # distinct records while there are enough: a repeated one could be copied from the drill before
    picks = rng.sample(range(len(records)), drills) if drills <= len(records) else [
        rng.randrange(len(records)) for _ in range(drills)]
    for i in picks:
        k, v = records[i]
        prompt += single_question(k)
        spans.append([len(prompt), len(prompt) + len(v) + 1])   # the value and its newline
        prompt += v + "\n"
    prompt += question
    answer = ", ".join(records[i][1] for i in asked)
    depth = asked[0] / max(1, len(records) - 1)
    return prompt, answer, depth, spans


def chain(rng, hops, used):
    names = [fresh(rng, VAR_CHARS, 5, used) for _ in range(hops)]
    value = "%05d" % rng.randrange(100000)
    lines = ["VAR %s = %s\n" % (names[0], value)]
    lines += ["VAR %s = %s\n" % (names[i], names[i - 1]) for i in range(1, hops)]
    return names, value, lines


def vartrack_task(rng, context, hops, distractors):
    used = set()
    target, value, lines = chain(rng, hops, used)
    others = [chain(rng, hops, used)[2] for _ in range(distractors)]
    question = "Question: what is the value of VAR %s?\nAnswer: " % target[-1]
    chain_bytes = sum(len(s) for c in [lines] + others for s in c)
    if len(HEADER) + len(question) + chain_bytes > context:
        raise ValueError("context %d is too short for %d chains of %d variables" % (context, distractors + 1, hops))
    records = [record(k, v) for k, v in fill_records(rng, context - len(HEADER) - len(question) - chain_bytes, set())]
    # Each chain keeps its order; chains and records interleave at random.
    slots = [None] * len(records) + [0] * len(lines) + [c + 1 for c in range(distractors) for _ in others[c]]
    rng.shuffle(slots)
    nexts = [0] * (distractors + 1)
    body, first_at, r = [], None, 0
    for s in slots:
        if s is None:
            body.append(records[r])
            r += 1
            continue
        src = lines if s == 0 else others[s - 1]
        if s == 0 and nexts[0] == 0:
            first_at = len(body)
        body.append(src[nexts[s]])
        nexts[s] += 1
    depth = first_at / max(1, len(body) - 1)
    return HEADER + "".join(body) + question, value, depth


def make_task(seed, split, variant, context, index, keys=4, hops=4, distractors=2, drills=0):
    """One task; drills > 0 (single and multikey only, for training) adds that
    many answered questions before the final one (kv_task) and a "drills" list
    of their answers' byte ranges."""
    rng = rng_for(seed, split, variant, context, index)
    spans = []
    if variant == "single":
        prompt, answer, depth, spans = kv_task(rng, context, 1, drills)
    elif variant == "multikey":
        prompt, answer, depth, spans = kv_task(rng, context, keys, drills)
    elif variant == "vartrack":
        prompt, answer, depth = vartrack_task(rng, context, hops, distractors)
    else:
        raise ValueError("unknown variant %r (one of %s)" % (variant, ", ".join(VARIANTS)))
    t = {"prompt": prompt, "answer": answer, "variant": variant, "context": context, "depth": round(depth, 4),
         "split": split, "seed": seed, "index": index}
    if spans:
        t["drills"] = spans
    return t


def tasks(seed, split, variants, contexts, n, **kw):
    """n tasks of every (variant, context), cell after cell."""
    for context in contexts:
        for variant in variants:
            for i in range(n):
                yield make_task(seed, split, variant, context, i, **kw)


# --------------------------------------------------------------------------
# What training sees: BOS, the prompt's bytes, the answer's and a newline,
# the loss on the answer and the newline only (what eval-task scores), and on
# the drills' answers of a training prompt that has them.

def encode(task):
    prompt = [BOS] + list(task["prompt"].encode())
    target = list((task["answer"] + "\n").encode())
    mask = [0] * len(prompt) + [1] * len(target)
    for start, end in task.get("drills", []):   # prompts are ASCII: byte offsets are character offsets
        mask[1 + start:1 + end] = [1] * (end - start)
    return prompt + target, mask


def train_batches(seed, variants, context, batch, start=0, offset=0, **kw):
    """Endless batches of the train split at one context, from batch `start`
    on (a resumed run continues where it stopped), the prompts numbered from
    `offset` (those earlier stages at this context drew): lists of (ids,
    mask) of equal length, right-padded with PAD (mask 0)."""
    step = start
    while True:
        items = []
        for j in range(batch):
            index = offset + step * batch + j
            items.append(encode(make_task(seed, "train", variants[index % len(variants)], context, index, **kw)))
        width = max(len(ids) for ids, _ in items)
        yield [(ids + [PAD] * (width - len(ids)), mask + [0] * (width - len(mask))) for ids, mask in items]
        step += 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the JSON lines file ('-': standard output)")
    ap.add_argument("--split", choices=["train", "heldout"], default="heldout")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--contexts", default="4096,8192,16384", help="target prompt lengths in bytes, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--n", type=int, default=500, help="prompts per (variant, context) cell")
    ap.add_argument("--keys", type=int, default=4, help="queries of a multikey prompt")
    ap.add_argument("--hops", type=int, default=4, help="variables of a vartrack chain")
    ap.add_argument("--distractors", type=int, default=2, help="other chains in a vartrack prompt")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error("unknown variant %s (one of %s)" % (", ".join(bad), ", ".join(VARIANTS)))
    try:
        contexts = [int(c) for c in a.contexts.split(",") if c]
    except ValueError:
        ap.error("--contexts takes whole numbers, comma-separated")
    out = sys.stdout if a.out == "-" else open(a.out, "w")
    try:
        for t in tasks(a.seed, a.split, variants, contexts, a.n, keys=a.keys, hops=a.hops, distractors=a.distractors):
            out.write(json.dumps(t) + "\n")
    except ValueError as e:
        ap.error(str(e))
    finally:
        if out is not sys.stdout:
            out.close()


if __name__ == "__main__":
    main()
