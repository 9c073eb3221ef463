#!/usr/bin/env python3
"""Writes a small Llama-2-style SentencePiece BPE tokenizer (byte fallback)
with the Python standard library alone, for machines without sentencepiece
and transformers:

    python3 make_spm_provisional.py OUTDIR

OUTDIR/spm_bpe/ gets the legacy layout transformers' LlamaConverter writes
(normalizer Prepend + Replace, no pre-tokenizer), OUTDIR/spm_bpe_metaspace/
the non-legacy one (Metaspace pre-tokenizer, prepend_scheme "first"); each
with a tokenizer_config.json. The vocabulary comes from a plain BPE trainer
over corpus/ (words start with U+2581, characters seen fewer than three
times are left to byte fallback). make_spm_tokenizer.py makes the same two
folders from a real sentencepiece model; its output replaces this one's.
"""
import collections
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SPACE = "\u2581"
VOCAB_SIZE = 1200
MIN_CHAR_COUNT = 3


def corpus_words():
    words = collections.Counter()
    for name in sorted(os.listdir(os.path.join(HERE, "corpus"))):
        with open(os.path.join(HERE, "corpus", name), encoding="utf-8", newline="") as f:
            text = SPACE + f.read().replace(" ", SPACE)
        word = ""
        for ch in text:
            if ch == SPACE and word:
                words[word] += 1
                word = ""
            word += ch
        if word:
            words[word] += 1
    return words


def train(words):
    chars = collections.Counter()
    for w, c in words.items():
        for ch in w:
            chars[ch] += c
    alphabet = sorted(ch for ch, c in chars.items() if c >= MIN_CHAR_COUNT)
    vocab = ["<unk>", "<s>", "</s>"] + ["<0x%02X>" % b for b in range(256)] + alphabet
    known = set(vocab)
    seqs = {w: [ch if ch in known else None for ch in w] for w in words}
    merges = []
    while len(vocab) < VOCAB_SIZE:
        pairs = collections.Counter()
        for w, seq in seqs.items():
            for a, b in zip(seq, seq[1:]):
                if a is not None and b is not None:
                    pairs[(a, b)] += words[w]
        if not pairs:
            break
        (a, b), count = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        if count < 2:
            break
        merges.append((a, b))
        if a + b not in known:
            vocab.append(a + b)
            known.add(a + b)
        for w, seq in seqs.items():
            out, i = [], 0
            while i < len(seq):
                if i + 1 < len(seq) and seq[i] == a and seq[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(seq[i])
                    i += 1
            seqs[w] = out
    return vocab, merges


def added(content, i):
    return {"id": i, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True}


def tokenizer_json(vocab, merges, legacy):
    template = {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                         {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    decoders = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}, {"type": "ByteFallback"},
                {"type": "Fuse"}]
    if legacy:
        decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [added("<unk>", 0), added("<s>", 1), added("</s>", 2)],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": SPACE},
            {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}]} if legacy else None,
        "pre_tokenizer": None if legacy else {"type": "Metaspace", "replacement": SPACE,
                                              "prepend_scheme": "first", "split": False},
        "post_processor": template,
        "decoder": {"type": "Sequence", "decoders": decoders} if legacy else
                   {"type": "Sequence", "decoders": [{"type": "Metaspace", "replacement": SPACE,
                                                       "prepend_scheme": "first", "split": False},
                                                      {"type": "ByteFallback"}, {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(vocab)}, "merges": [[a, b] for a, b in merges]},
    }


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    vocab, merges = train(corpus_words())
    config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False, "tokenizer_class": "LlamaTokenizerFast"}
    for name, legacy in (("spm_bpe", True), ("spm_bpe_metaspace", False)):
        folder = os.path.join(sys.argv[1], name)
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tokenizer_json(vocab, merges, legacy), f, ensure_ascii=False, indent=1)
        with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(dict(config, legacy=legacy), f, ensure_ascii=False, indent=1)
        print(f"wrote {folder}/tokenizer.json ({len(vocab)} tokens, {len(merges)} merges) and tokenizer_config.json")


if __name__ == "__main__":
    main()
