"""Text beside token ids: the built-in byte tokenizer and prompt normalization.

By default text goes to the server as text and comes back as text, through
the server's tokenizer (docs/protocol.md, generate's prompt_text and
return_text). A client may keep its own tokenizer instead: any object with
Hugging Face's `encode(text) -> ids` and `decode(ids) -> text` (a trainer
already holds one for its model), or ByteTokenizer for byte-level models
(ids 0-255 are bytes, 256 BOS, 257 EOS, 258 PAD: the bundled demo model and
the project's test models); prompts then go as ids, decoded here.
"""
from typing import List, Optional, Sequence


class ByteTokenizer:
    """The byte-level models' tokenizer, with the Hugging Face method names."""

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258

    def __init__(self, vocab_size: int = 272):
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out = bytearray()
        for i in ids:
            i = int(i)
            if i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out += f"<{i}>".encode()
        return out.decode("utf-8", errors="replace")

    def __call__(self, text: str):
        return {"input_ids": self.encode(text)}


def is_byte_vocabulary(hello: dict) -> bool:
    """Whether a server's model is byte-level, from its hello reply."""
    return 257 <= int(hello.get("vocab_size", 0)) <= 512 and list(hello.get("eos_token_ids", [])) == [257]


def _is_int(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, int):
        return True
    if len(getattr(v, "shape", ())) != 0:
        return False   # an array, not a scalar
    # numpy and torch integer scalars
    kind = getattr(getattr(v, "dtype", None), "kind", None)
    if kind in ("i", "u"):
        return True
    dt = str(getattr(v, "dtype", ""))
    return dt.startswith("torch.int") or dt.startswith("torch.uint")


def is_single_prompt(p) -> bool:
    """True for one prompt (text, or a flat sequence of ids), False for a batch
    (a sequence of prompts, or a 2-D array: one prompt per row)."""
    if isinstance(p, str):
        return True
    shape = getattr(p, "shape", None)
    if shape is not None and not isinstance(p, (list, tuple)):
        return len(shape) == 1
    return len(p) > 0 and _is_int(p[0])


def prompt_ids(p, tokenizer, what: str = "prompt") -> List[int]:
    """One prompt as a list of Python ints: text through the tokenizer; a list,
    tuple, numpy or torch integer array as it is. Raises ValueError for an
    empty prompt, text without a tokenizer, or values that are not ids."""
    if isinstance(p, str):
        if tokenizer is None:
            raise ValueError(f"{what} is text, and neither the server nor this client has a tokenizer: start the "
                             "server with one (serve --tokenizer), give RolloutClient(tokenizer=...) (any object "
                             "with encode/decode), or send token ids")
        ids = tokenizer.encode(p)
        ids = ids.get("input_ids", ids) if isinstance(ids, dict) else ids
    else:
        ids = p
    if not hasattr(ids, "__len__"):
        raise ValueError(f"{what}: {ids!r} is neither text nor a sequence of token ids")
    if hasattr(ids, "tolist") and not isinstance(ids, (list, tuple)):
        shape = getattr(ids, "shape", None)
        if shape is not None and len(shape) != 1:
            raise ValueError(f"{what}: a prompt is one-dimensional, got shape {tuple(shape)}")
        kind = str(getattr(ids, "dtype", ""))
        if not (getattr(ids.dtype, "kind", "") in ("i", "u") or kind.startswith("torch.int") or
                kind.startswith("torch.uint")):
            raise ValueError(f"{what}: token ids must be integers, got dtype {kind}")
        ids = ids.tolist()
    out = []
    for k, v in enumerate(ids):
        if not _is_int(v):
            raise ValueError(f"{what}: entry {k} is {v!r}, not a token id")
        out.append(int(v))
    if not out:
        raise ValueError(f"{what} is empty")
    return out


def decode(tokenizer, ids: Sequence[int]) -> Optional[str]:
    return None if tokenizer is None else tokenizer.decode(list(ids))
