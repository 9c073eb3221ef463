"""Qwen3ForCausalLM in plain PyTorch, with the safetensors reader and writer
the project's training scripts and the DAPO trainer share: no transformers,
no other package, so it runs on Debian's PyTorch (1.13) as on current ones.

Parameter names are the checkpoint's (model.layers.N.self_attn.q_proj.weight,
...), so `named_parameters()` is exactly what `update_weights` sends and
`save_checkpoint` writes the folder fp4rollout serves.

Attention uses torch.nn.functional.scaled_dot_product_attention where the
PyTorch has it (2.0 on: flash or memory-efficient kernels, which long
contexts need on a GPU), else the product written out.

    python3 qwen3.py --model DIR --check-golden p1,p2,p6

compares the logits with the `pN.logits_f32` tensors of DIR/golden.safetensors
(transformers' float32 outputs) and exits non-zero when the largest error
exceeds --tol of the largest reference logit.
"""
import argparse
import inspect
import json
import math
import os
import struct
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# ---------------------------------------------------------------- safetensors

_DTYPES = {"F32": torch.float32, "F16": torch.float16, "I32": torch.int32, "I64": torch.int64,
           "BF16": None}   # BF16 is widened to float32 by hand (below)


def read_safetensors(path):
    """{name: tensor} of one safetensors file. BF16 tensors come back as float32
    (exact: a BF16 value is the top half of its float32)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise ValueError(f"{path}: too short for a safetensors file")
    (hlen,) = struct.unpack("<Q", blob[:8])
    if 8 + hlen > len(blob):
        raise ValueError(f"{path}: header length {hlen} runs past the end of the file")
    header = json.loads(blob[8:8 + hlen].decode("utf-8"))
    base = 8 + hlen
    data = bytearray(blob[base:])          # writable, so torch.frombuffer does not warn
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype, shape = meta["dtype"], meta["shape"]
        start, end = meta["data_offsets"]
        if dtype not in _DTYPES:
            raise ValueError(f"{path}: {name}: unsupported dtype {dtype}")
        count = math.prod(shape)
        if dtype == "BF16":
            if end - start != 2 * count:
                raise ValueError(f"{path}: {name}: {end - start} bytes for {count} bf16 values")
            raw = torch.frombuffer(data, dtype=torch.int16, count=count, offset=start) if count else \
                torch.empty(0, dtype=torch.int16)
            wide = (raw.to(torch.int32) & 0xFFFF) << 16
            t = wide.view(torch.float32)
        else:
            tdt = _DTYPES[dtype]
            size = torch.tensor([], dtype=tdt).element_size()
            if end - start != size * count:
                raise ValueError(f"{path}: {name}: {end - start} bytes for {count} {dtype} values")
            t = torch.frombuffer(data, dtype=tdt, count=count, offset=start).clone() if count else \
                torch.empty(0, dtype=tdt)
        out[name] = t.reshape(shape)
    return out


def read_checkpoint(folder):
    """Every tensor of a checkpoint folder: model.safetensors.index.json's shards,
    or the single model.safetensors."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
    else:
        shards = ["model.safetensors"]
    tensors = {}
    for s in shards:
        for k, v in read_safetensors(os.path.join(folder, s)).items():
            if k in tensors:
                raise ValueError(f"{folder}: tensor {k} appears in two shards")
            tensors[k] = v
    return tensors


def save_safetensors(tensors, path, dtype="BF16"):
    """Writes {name: tensor} as one safetensors file, BF16 (rounded to nearest
    even, as torch's cast) or F32, names sorted; atomically (a temporary file
    renamed), so a run killed while writing keeps the previous file."""
    if dtype not in ("BF16", "F32"):
        raise ValueError(f"save_safetensors: dtype {dtype!r} (BF16 or F32)")
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu")
        if dtype == "BF16":
            raw = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().tobytes()
        else:
            raw = t.to(torch.float32).contiguous().numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    header["__metadata__"] = {"format": "pt"}
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)       # the data starts 8-aligned
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def save_state_file(obj, path):
    """torch.save of a training run's resumable state, atomically: a run
    killed while saving keeps the previous file."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def load_state_file(path, device):
    """torch.load of a state save_state_file wrote. Such states may hold Python
    random states, which PyTorch 2.6 on refuses to unpickle by default."""
    kw = {"weights_only": False} if "weights_only" in inspect.signature(torch.load).parameters else {}
    return torch.load(path, map_location=device, **kw)


# ---------------------------------------------------------------- model

# None on PyTorch before 2.0 (Debian 12 has 1.13): the product is written out.
_SDPA = getattr(F, "scaled_dot_product_attention", None)

class Config:
    def __init__(self, d):
        self.vocab_size = d["vocab_size"]
        self.hidden_size = d["hidden_size"]
        self.intermediate_size = d["intermediate_size"]
        self.num_layers = d["num_hidden_layers"]
        self.num_heads = d["num_attention_heads"]
        self.num_kv_heads = d.get("num_key_value_heads", self.num_heads)
        self.head_dim = d.get("head_dim") or self.hidden_size // self.num_heads
        self.eps = d.get("rms_norm_eps", 1e-6)
        rope = d.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        self.tie_word_embeddings = bool(d.get("tie_word_embeddings", False))
        # The engine serves YaRN-scaled RoPE; this model computes plain RoPE
        # only, so its log-probs would silently differ from the engine's.
        for key in ("rope_parameters", "rope_scaling"):
            scaling = d.get(key) or {}
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind != "default":
                raise ValueError("%s: RoPE type %r is not implemented here (plain RoPE only)" % (key, kind))
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.eps)    # per head, before RoPE
        self.k_norm = RMSNorm(c.head_dim, c.eps)

    def forward(self, x, cos, sin, mask, cache=None):
        c = self.c
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, c.num_heads, c.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if cache is not None:
            if cache:
                k, v = torch.cat((cache[0], k), dim=2), torch.cat((cache[1], v), dim=2)
            cache[:] = [k, v]
        group = c.num_heads // c.num_kv_heads      # query head h reads KV head h // group
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        if _SDPA is not None:
            # under autocast v leaves its matmul in BF16 while the norms and RoPE
            # widen q and k; the kernel wants one dtype. With earlier keys in a
            # cache the causal mask is not the square one is_causal means.
            square = k.shape[2] == T
            out = _SDPA(q.to(v.dtype), k.to(v.dtype), v, attn_mask=None if square else mask, is_causal=square)
        else:
            scores = (q @ k.transpose(-1, -2)) * (c.head_dim ** -0.5)
            if mask is not None:
                scores = scores + mask
            out = torch.softmax(scores, dim=-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(B, T, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.eps)
        self.mlp = MLP(c)

    def forward(self, x, cos, sin, mask, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.num_layers)])
        self.norm = RMSNorm(c.hidden_size, c.eps)


class Qwen3(nn.Module):
    """Qwen3ForCausalLM: forward(ids [B, T]) -> logits [B, T, vocab]. Positions are
    0..T-1 in every row, attention is causal: pad on the right."""

    def __init__(self, c):
        super().__init__()
        self.config = c
        self.model = Backbone(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        self.register_buffer("inv_freq", inv.float(), persistent=False)

    def new_cache(self):
        """An empty KV cache for forward(ids, cache): one [keys, values] per layer."""
        return [[] for _ in self.model.layers]

    def forward(self, ids, cache=None):
        """With a cache (new_cache()), ids continue the sequence the cache holds:
        their positions follow it, they attend to it, and their keys and values
        join it (every row of the batch the same length)."""
        B, T = ids.shape
        past = cache[0][0].shape[2] if cache and cache[0] else 0
        pos = torch.arange(past, past + T, dtype=torch.float32, device=ids.device)
        freqs = torch.outer(pos, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        mask = None
        if _SDPA is None or past:
            # query i (position past + i) sees keys 0 .. past + i
            mask = torch.full((T, past + T), float("-inf"), device=ids.device).triu(past + 1)
            if _SDPA is not None:
                mask = mask == 0      # SDPA's boolean mask: True where attention is allowed
        x = self.model.embed_tokens(ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, mask, None if cache is None else cache[i])
        x = self.model.norm(x)
        if self.config.tie_word_embeddings:
            return x @ self.model.embed_tokens.weight.t()
        return self.lm_head(x)


def load_policy(folder):
    """The float32 policy of a checkpoint folder; every checkpoint tensor must be a
    parameter of the model and every parameter must be in the checkpoint."""
    with open(os.path.join(folder, "config.json")) as f:
        cfg = Config(json.load(f))
    model = Qwen3(cfg)
    tensors = read_checkpoint(folder)
    own = dict(model.named_parameters())
    missing = sorted(set(own) - set(tensors))
    extra = sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"{folder}: checkpoint/model mismatch: missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, p in own.items():
            t = tensors[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)}, model {tuple(p.shape)}")
            p.copy_(t.float())
    return model


# ---------------------------------------------------------------- byte models

# The byte tokenizer of the project's test models: ids 0..255 are bytes.
BOS, EOS, PAD, VOCAB = 256, 257, 258, 272


def byte_model_config(hidden, intermediate, layers, heads, kv_heads, head_dim, max_position,
                      rope_theta=1000000.0):
    """config.json of a byte-level Qwen3 test model (untied embeddings)."""
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
        "hidden_size": hidden, "intermediate_size": intermediate, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": rope_theta,
        "max_position_embeddings": max_position, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "torch_dtype": "bfloat16",
        "use_sliding_window": False,
    }


def new_model(config):
    """A freshly initialised Qwen3 of a config dict: normal(0.02) matrices and
    residual projections scaled down by sqrt(2 x layers), as deep stacks need;
    norms at 1. The same seed gives the same weights."""
    model = Qwen3(Config(config))
    for _, p in model.named_parameters():
        if p.dim() == 2:
            nn.init.normal_(p, std=0.02)
    scale = 0.02 / math.sqrt(2 * config["num_hidden_layers"])
    for layer in model.model.layers:
        nn.init.normal_(layer.self_attn.o_proj.weight, std=scale)
        nn.init.normal_(layer.mlp.down_proj.weight, std=scale)
    return model


def save_checkpoint(model, config, folder, dtype="BF16"):
    """The Hugging Face folder fp4rollout loads: config.json, generation_config.json
    (the byte tokenizer's ids) and model.safetensors."""
    os.makedirs(folder, exist_ok=True)
    cfg = dict(config, torch_dtype="bfloat16" if dtype == "BF16" else "float32")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": cfg.get("bos_token_id", BOS), "eos_token_id": cfg.get("eos_token_id", EOS),
                   "pad_token_id": cfg.get("pad_token_id", PAD)}, f, indent=2)
        f.write("\n")
    save_safetensors(model.state_dict(), os.path.join(folder, "model.safetensors"), dtype)


@torch.no_grad()
def greedy(model, ids, max_new, stop_ids=(EOS,)):
    """Greedy continuation of one prompt (a list of ids), at most max_new ids,
    ending at (and including) the first of stop_ids. No KV cache: every step
    runs the whole sequence, which is what short answers after long prompts
    cost anyway."""
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    seq = list(ids)
    out = []
    for _ in range(max_new):
        nxt = int(model(torch.tensor([seq], device=dev))[0, -1].argmax())
        out.append(nxt)
        seq.append(nxt)
        if nxt in stop_ids:
            break
    model.train(was_training)
    return out


def _pick(logits, temperature, generator):
    """[B, 1] next ids of [B, 1, vocab] logits: the argmax, or a draw from
    softmax(logits / temperature) made on the CPU from `generator`, so the
    draws do not depend on the device."""
    if temperature <= 0:
        return logits[:, -1:].argmax(-1)
    probs = torch.softmax(logits[:, -1].float() / temperature, dim=-1)
    return torch.multinomial(probs.cpu(), 1, generator=generator).to(logits.device)


@torch.no_grad()
def greedy_batch(model, prompts, max_new, stop_ids=(EOS,), temperature=0.0, generator=None):
    """Continuations of equal-length prompts (lists of ids) with a KV cache:
    one prefill, then one position per new id. One list per prompt, ending at
    (and including) the first of stop_ids (an id or several) or after max_new
    ids. Greedy by default; temperature > 0 samples (see _pick). The same ids
    as greedy() up to rounding (another order of sums can turn a near tie)."""
    if len({len(p) for p in prompts}) != 1:
        raise ValueError("greedy_batch: the prompts must have the same length")
    stops = (stop_ids,) if isinstance(stop_ids, int) else tuple(stop_ids)
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    cache = model.new_cache()
    logits = model(torch.tensor(prompts, dtype=torch.long, device=dev), cache)
    stop_t = torch.tensor(stops, dtype=torch.long, device=dev)
    done = torch.zeros(len(prompts), dtype=torch.bool, device=dev)
    out = []
    for i in range(max_new):
        nxt = _pick(logits, temperature, generator)          # [B, 1]
        out.append(nxt)
        done |= torch.isin(nxt[:, 0], stop_t)
        if bool(done.all()) or i == max_new - 1:
            break
        logits = model(nxt, cache)
    model.train(was_training)
    rows = torch.cat(out, dim=1).tolist() if out else [[] for _ in prompts]
    return [next((r[:k + 1] for k, x in enumerate(r) if x in stops), r) for r in rows]


def greedy_cached(model, ids, max_new, stop_ids=(EOS,)):
    """greedy() with a KV cache: greedy_batch of one prompt."""
    return greedy_batch(model, [list(ids)], max_new, stop_ids)[0]


def check_golden(model, golden_path, prompts):
    """{prompt: max |logit - golden| / max |golden|} for the given pN names."""
    g = read_safetensors(golden_path)
    errs = {}
    with torch.no_grad():
        for p in prompts:
            ids = g[f"{p}.ids"].long()[None]
            ref = g[f"{p}.logits_f32"]
            got = model(ids)[0]
            errs[p] = float((got - ref).abs().max() / ref.abs().max())
    return errs


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder")
    ap.add_argument("--check-golden", default="p1,p2,p6", help="comma-separated prompt names of golden.safetensors")
    ap.add_argument("--golden", default=None, help="golden file (default MODEL/golden.safetensors)")
    ap.add_argument("--tol", type=float, default=1e-3, help="largest error allowed, relative to max |logit|")
    a = ap.parse_args()
    model = load_policy(a.model)
    n = sum(p.numel() for p in model.parameters())
    errs = check_golden(model, a.golden or os.path.join(a.model, "golden.safetensors"), a.check_golden.split(","))
    worst = max(errs.values())
    print(f"qwen3: {n} parameters; logits vs golden, max error / max |logit|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()) + f" (limit {a.tol:g})")
    sys.exit(0 if worst <= a.tol else 1)


if __name__ == "__main__":
    main()
