#!/usr/bin/env python3
"""Makes the two SentencePiece-style test tokenizers the way Llama 2's
tokenizer.json came to be: trains a small sentencepiece BPE model with byte
fallback on corpus/, then converts it with transformers' Llama converter.

    python3 tests/data/tokenizer/make_spm_tokenizer.py OUTDIR

OUTDIR/spm_bpe/ gets the legacy conversion (normalizer Prepend + Replace),
OUTDIR/spm_bpe_metaspace/ the non-legacy one (Metaspace pre-tokenizer,
prepend_scheme "first"): tokenizer.json and tokenizer_config.json each, and
OUTDIR/spm_bpe/spm.model, the sentencepiece model they came from. With
OUTDIR = tests/data/tokenizer these replace the provisional ones of
make_spm_provisional.py; run tokenizer_golden.py afterwards. Needs
sentencepiece and transformers (protobuf too, for the conversion).
"""
import json
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def training_text(path):
    """Every non-empty line of the corpus, one sentence per line."""
    with open(path, "w", encoding="utf-8") as out:
        for name in sorted(os.listdir(os.path.join(HERE, "corpus"))):
            with open(os.path.join(HERE, "corpus", name), encoding="utf-8", newline="") as f:
                for line in f.read().splitlines():
                    if line.strip():
                        out.write(line + "\n")


def train(text_path, prefix):
    import sentencepiece as spm

    last = None
    for vocab_size in (1500, 2500, 1000, 800):
        try:
            spm.SentencePieceTrainer.train(
                input=text_path, model_prefix=prefix, model_type="bpe", vocab_size=vocab_size,
                byte_fallback=True, character_coverage=0.995, split_digits=True, add_dummy_prefix=True,
                normalization_rule_name="identity", remove_extra_whitespaces=False,
                allow_whitespace_only_pieces=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                hard_vocab_limit=False, max_sentence_length=65536, num_threads=1, minloglevel=2)
            print(f"trained a sentencepiece BPE model of {vocab_size} pieces (byte fallback)")
            return
        except (RuntimeError, OSError) as e:
            last = e
            print(f"vocab_size {vocab_size}: {e}; trying another size")
    sys.exit(f"sentencepiece training failed: {last}")


def convert(model_path, legacy, dest):
    """tokenizer.json of the model as transformers converts it."""
    try:
        from transformers import LlamaTokenizer
        from transformers.convert_slow_tokenizer import convert_slow_tokenizer

        slow = LlamaTokenizer(vocab_file=model_path, legacy=legacy, add_bos_token=True, add_eos_token=False)
        convert_slow_tokenizer(slow).save(dest)
        return "LlamaTokenizer + convert_slow_tokenizer"
    except Exception as e:  # transformers without slow tokenizers converts in the fast class
        print(f"slow conversion unavailable ({e}); converting through LlamaTokenizerFast")
        from transformers import LlamaTokenizerFast

        fast = LlamaTokenizerFast(vocab_file=model_path, legacy=legacy, from_slow=True, add_bos_token=True,
                                  add_eos_token=False)
        fast.backend_tokenizer.save(dest)
        return "LlamaTokenizerFast(from_slow=True)"


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    out = sys.argv[1]
    import sentencepiece
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        text = os.path.join(tmp, "corpus.txt")
        training_text(text)
        train(text, os.path.join(tmp, "spm"))
        model = os.path.join(tmp, "spm.model")
        config = {"add_bos_token": True, "add_eos_token": False, "bos_token": "<s>", "eos_token": "</s>",
                  "unk_token": "<unk>", "clean_up_tokenization_spaces": False,
                  "tokenizer_class": "LlamaTokenizerFast"}
        for name, legacy in (("spm_bpe", True), ("spm_bpe_metaspace", False)):
            folder = os.path.join(out, name)
            os.makedirs(folder, exist_ok=True)
            staged = os.path.join(tmp, name + ".json")
            how = convert(model, legacy, staged)
            with open(staged, encoding="utf-8") as f:
                tj = json.load(f)
            # transformers 5.17's fast Llama class, given only the model file,
            # wrote a vocabulary of its 3 special tokens: never let such a
            # conversion replace the committed tokenizer.
            pieces = sentencepiece.SentencePieceProcessor(model_file=model).get_piece_size()
            if len(tj["model"]["vocab"]) < pieces:
                sys.exit(f"{name}: the conversion ({how}, transformers {transformers.__version__}) kept "
                         f"{len(tj['model']['vocab'])} of the model's {pieces} pieces; nothing written")
            shutil.move(staged, os.path.join(folder, "tokenizer.json"))
            with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
                json.dump(dict(config, legacy=legacy), f, ensure_ascii=False, indent=1)
                f.write("\n")
            print(f"wrote {folder}/tokenizer.json ({len(tj['model']['vocab'])} tokens, "
                  f"{len(tj['model']['merges'])} merges; {how}, transformers {transformers.__version__}, "
                  f"legacy={legacy}) and tokenizer_config.json")
        shutil.copy(model, os.path.join(out, "spm_bpe", "spm.model"))
        print(f"wrote {os.path.join(out, 'spm_bpe', 'spm.model')}")


if __name__ == "__main__":
    main()
