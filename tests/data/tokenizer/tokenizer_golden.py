#!/usr/bin/env python3
"""Records the ground truth the tokenizer tests compare with: for every
tokenizer of variants.json and every text of corpus/, what Hugging Face
`tokenizers` (Python) encodes and decodes, what its DecodeStream streams,
and, for the unpatched tokenizers, what transformers' AutoTokenizer encodes
from the tokenizer's folder (tokenizer_config.json included).

    python3 tests/data/tokenizer/tokenizer_golden.py OUTDIR [--shared DIR]

OUTDIR: where the golden files go (tests/data/tokenizer/golden in the
repository); one NAME.json per variant. --shared: the folder holding
qwen3/ and deepseek_v3/ (default: ../shared/tokenizers beside the
repository). Needs `tokenizers`; `transformers` is optional (its ids are
then left out). Run make_spm_tokenizer.py first when the SentencePiece
tokenizers are to be remade.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))


def base_dir(base, shared):
    kind, name = base.split(":", 1)
    if kind == "shared":
        return os.path.join(shared, name)
    if kind == "data":
        return os.path.join(HERE, name)
    raise ValueError(f"unknown base {base}")


def apply_patches(obj, patches):
    for path, value in patches:
        o = obj
        for k in path[:-1]:
            o = o[k]
        o[path[-1]] = value
    return obj


def corpus():
    d = os.path.join(HERE, "corpus")
    out = []
    for f in sorted(os.listdir(d)):
        if f.endswith(".txt"):
            with open(os.path.join(d, f), encoding="utf-8", newline="") as fh:
                out.append((f[:-4], fh.read()))
    return out


def stream_chunks(tok, ids):
    try:
        from tokenizers.decoders import DecodeStream
    except ImportError:
        return None
    ds = DecodeStream(skip_special_tokens=False)
    return [ds.step(tok, i) for i in ids]


def transformers_tokenizer(folder):
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    return AutoTokenizer.from_pretrained(folder)


def record(variant, shared, items, source):
    from tokenizers import Tokenizer

    folder = base_dir(variant["base"], shared)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.exists(path):
        print(f"skip {variant['name']}: {path} not found")
        return None
    with open(path, encoding="utf-8") as f:
        obj = apply_patches(json.load(f), variant["patches"])
    tok = Tokenizer.from_str(json.dumps(obj, ensure_ascii=False))
    hf = transformers_tokenizer(folder) if not variant["patches"] else None
    out = {"name": variant["name"], "base": variant["base"], "patches": variant["patches"], "source": source,
           "vocab_size": tok.get_vocab_size(with_added_tokens=True), "items": {}}
    for name, text in items:
        ids = tok.encode(text, add_special_tokens=False).ids
        ids_special = tok.encode(text, add_special_tokens=True).ids
        item = {"ids": ids, "ids_special": ids_special,
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_special": tok.decode(ids_special, skip_special_tokens=False),
                "decoded_skip": tok.decode(ids_special, skip_special_tokens=True)}
        chunks = stream_chunks(tok, ids_special)
        if chunks is not None:
            item["stream"] = chunks
        if hf is not None:
            item["transformers_ids"] = hf(text, add_special_tokens=False)["input_ids"]
            item["transformers_ids_special"] = hf(text, add_special_tokens=True)["input_ids"]
        out["items"][name] = item
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("outdir")
    ap.add_argument("--shared", default=os.path.join(ROOT, "..", "shared", "tokenizers"))
    args = ap.parse_args()
    import tokenizers

    source = f"Hugging Face tokenizers {tokenizers.__version__} (Python)"
    try:
        import transformers
        source += f", transformers {transformers.__version__}"
    except ImportError:
        print("transformers not installed: its ids are left out")
    with open(os.path.join(HERE, "variants.json"), encoding="utf-8") as f:
        variants = json.load(f)["variants"]
    items = corpus()
    os.makedirs(args.outdir, exist_ok=True)
    wrote = 0
    for v in variants:
        g = record(v, args.shared, items, source)
        if g is None:
            continue
        dest = os.path.join(args.outdir, v["name"] + ".json")
        with open(dest, "w", encoding="utf-8") as f:
            json.dump(g, f, ensure_ascii=False, separators=(",", ":"))
            f.write("\n")
        n = sum(len(x["ids"]) for x in g["items"].values())
        print(f"wrote {dest}: {len(items)} texts, {n} ids ({source})")
        wrote += 1
    if not wrote:
        sys.exit("no golden file written: no tokenizer found")


if __name__ == "__main__":
    main()
