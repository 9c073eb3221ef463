#!/usr/bin/env python3
"""Trains the DeepSeek mixture-of-experts test models and writes their golden
files (models/dsmoe/README.md is their card).

Two small byte-level models with multi-head latent attention, a dense first
layer and DeepSeek's routed and shared experts in the others:

  dsmoe   DeepseekV3ForCausalLM: sigmoid scores, noaux_tc routing (4 groups,
          2 kept, ranked by their two best biased scores) with an explicit,
          nonzero e_score_correction_bias (a buffer backprop does not train),
          renormalized weights times routed_scaling_factor 2.5, one shared
          expert, a query low-rank path;
  dsmoe2  DeepseekV2ForCausalLM: softmax scores, group_limited_greedy (4
          groups, 2 kept, ranked by their best score), weights times
          routed_scaling_factor 1.5 without renormalization, two shared
          experts, no query low-rank path.

Each is trained briefly on tq6's texts (so that the router is far from
uniform), then run in float32 with transformers' own forward pass (on the
CPU, or with --golden-device cuda on the GPU with TF32 off):

  model.safetensors   float32 weights under the published checkpoints' names,
                      each a BF16 value (rounded after training, so that the
                      CUDA engine's BF16 weights are the same; --f32-weights
                      keeps them as trained)
                      (per-expert tensors, mlp.gate.weight, the router bias
                      mlp.gate.e_score_correction_bias, mlp.shared_experts.*)
  config.json, generation_config.json, train_info.json
  golden.safetensors  tq6's golden prompts p0..p6 as tqa's golden file has
                      them: pN.ids (I32, BOS first), pN.logits_f32 (F32
                      [len, 272]; every prompt but p5, whose 4096 rows would
                      double the file), pN.greedy (I32 [64]), and for the
                      routed-expert replay pN.routes (U8 [len + 63, MoE
                      layers, top-k]: the experts each MoE layer chose at
                      every position of pN.ids + pN.greedy[:63], ascending)
                      and pN.route_margin (F32 [len + 63, MoE layers]: the
                      smallest gap between the choices that decided them)

Needs PyTorch and transformers 5.x (4.x layouts are handled too); one GPU
trains in about a minute (the CPU works, slowly). It checks as it goes and
fails loudly: the router's choices recomputed from the rules the engine
implements (docs/deepseek_moe.md) must equal transformers' own wherever
the choice is not a near-tie, the written checkpoint must load back into
transformers with no missing or unexpected tensor and give the same
logits, and the outputs must stay under 20 MB.

    python3 models/dsmoe/train_dsmoe.py --tq6 ../shared/models/tq6 --out ../shared/models
    python3 models/dsmoe/train_dsmoe.py --variant dsmoe --steps 50 --out /tmp/x   # a quick check
    python3 models/dsmoe/train_dsmoe.py --golden-device cuda --out OUT   # golden outputs on the GPU too
"""
import argparse
import json
import math
import os
import random
import struct
import sys
import time

import torch
import torch.nn.functional as F

BOS, EOS, PAD, VOCAB = 256, 257, 258, 272
GREEDY = 64
MAX_BYTES = 20 * 1000 * 1000
LOGIT_ROWS_CAP = 2048          # prompts longer than this keep no logits (p5)
MARGIN = 1e-4                  # choices closer than this are near-ties


def die(msg):
    print("train_dsmoe: ERROR: " + msg, file=sys.stderr)
    sys.exit(1)


# --------------------------------------------------------------------------
# configurations

def model_config(variant):
    common = {
        "vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "head_dim": 64, "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
        "first_k_dense_replace": 1, "moe_layer_freq": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": 8192, "rope_theta": 10000.0,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD, "initializer_range": 0.02,
        "use_cache": True,
    }
    if variant == "dsmoe":
        c = dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", q_lora_rank=64,
                 n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, topk_method="noaux_tc",
                 scoring_func="sigmoid", rope_interleave=True, num_nextn_predict_layers=0)
    else:
        c = dict(common, architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", q_lora_rank=None,
                 n_shared_experts=2, routed_scaling_factor=1.5, norm_topk_prob=False,
                 topk_method="group_limited_greedy", scoring_func="softmax", mlp_bias=False)
    return c


def build_model(cfg):
    import transformers
    if cfg["model_type"] == "deepseek_v3":
        config_cls, model_cls = transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    else:
        config_cls, model_cls = transformers.DeepseekV2Config, transformers.DeepseekV2ForCausalLM
    kw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw.pop("rope_theta")          # transformers 5 reads rope_parameters
    else:
        kw.pop("rope_parameters")
    config = config_cls(**kw)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta != cfg["rope_theta"]:
        die("transformers' %s took RoPE theta %r, the script asked %r" % (config_cls.__name__, theta, cfg["rope_theta"]))
    for key in ("n_group", "topk_group", "n_routed_experts", "num_experts_per_tok", "first_k_dense_replace",
                "routed_scaling_factor", "n_shared_experts", "q_lora_rank", "kv_lora_rank"):
        if getattr(config, key, None) != cfg[key]:
            die("transformers' %s took %s = %r, the script asked %r" % (config_cls.__name__, key,
                                                                         getattr(config, key, None), cfg[key]))
    # eager attention and the eager expert loop: float32 everywhere, no
    # kernel that wants another dtype (transformers 5 can route experts
    # through grouped_mm)
    if hasattr(config, "_experts_implementation"):
        config._experts_implementation = "eager"
    try:
        model = model_cls._from_config(config, attn_implementation="eager", experts_implementation="eager")
    except TypeError:
        try:
            model = model_cls._from_config(config, attn_implementation="eager")
        except TypeError:
            config._attn_implementation = "eager"
            model = model_cls(config)
    return model.float(), config, model_cls


def moe_blocks(model, cfg):
    """The MoE modules in layer order (transformers' layer l >= first_k_dense_replace)."""
    blocks = []
    for l, layer in enumerate(model.model.layers):
        is_moe = hasattr(layer.mlp, "experts")
        if is_moe != (l >= cfg["first_k_dense_replace"]):
            die("layer %d of transformers' model is %s, the config says otherwise" % (l, "MoE" if is_moe else "dense"))
        if is_moe:
            blocks.append(layer.mlp)
    return blocks


def set_router_bias(model, cfg):
    """An explicit, nonzero, positive e_score_correction_bias (DeepSeek-V3
    only): training does not move it. Positive keeps every biased choice
    above the 0.0 that transformers gives the dropped groups' experts, so no
    selection depends on how torch.topk orders equal values."""
    if cfg["model_type"] != "deepseek_v3":
        return []
    out = []
    with torch.no_grad():
        for m, mlp in enumerate(moe_blocks(model, cfg)):
            E = cfg["n_routed_experts"]
            b = torch.tensor([0.02 + 0.1 * (((e * 7 + m * 5) % E) / (E - 1)) for e in range(E)], dtype=torch.float32)
            mlp.gate.e_score_correction_bias.copy_(b)
            out.append([round(float(x), 6) for x in b])
    return out


# --------------------------------------------------------------------------
# safetensors without the package: the header, then the tensors' bytes

ST_DTYPES = {torch.float32: ("F32", "f"), torch.int32: ("I32", "i"), torch.uint8: ("U8", "B")}


def write_safetensors(path, tensors, metadata):
    header, blobs, at = {"__metadata__": metadata}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        if t.dtype not in ST_DTYPES:
            die("%s: dtype %s is not written" % (name, t.dtype))
        data = t.numpy().tobytes()
        header[name] = {"dtype": ST_DTYPES[t.dtype][0], "shape": list(t.shape), "data_offsets": [at, at + len(data)]}
        blobs.append(data)
        at += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return os.path.getsize(path)


def read_safetensors_ints(path):
    """The I32 tensors of a safetensors file, as lists."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        out = {}
        for name, t in header.items():
            if name == "__metadata__" or t["dtype"] != "I32":
                continue
            a, b = t["data_offsets"]
            f.seek(base + a)
            out[name] = list(struct.unpack("<%di" % ((b - a) // 4), f.read(b - a)))
    return out


# --------------------------------------------------------------------------
# the checkpoint's names: per-expert tensors, whatever layout the model uses

def expected_names(cfg):
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for l in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % l
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        if cfg["q_lora_rank"]:
            names += [a + "q_a_proj.weight", a + "q_a_layernorm.weight", a + "q_b_proj.weight"]
        else:
            names += [a + "q_proj.weight"]
        names += [a + "kv_a_proj_with_mqa.weight", a + "kv_a_layernorm.weight", a + "kv_b_proj.weight",
                  a + "o_proj.weight"]
        if l < cfg["first_k_dense_replace"]:
            names += [p + "mlp.%s_proj.weight" % w for w in ("gate", "up", "down")]
            continue
        names += [p + "mlp.gate.weight"]
        if cfg["topk_method"] == "noaux_tc":
            names += [p + "mlp.gate.e_score_correction_bias"]
        for e in range(cfg["n_routed_experts"]):
            names += [p + "mlp.experts.%d.%s_proj.weight" % (e, w) for w in ("gate", "up", "down")]
        names += [p + "mlp.shared_experts.%s_proj.weight" % w for w in ("gate", "up", "down")]
    return names


def checkpoint_tensors(model, cfg):
    """The state dict under the published checkpoints' names (transformers 5
    keeps each layer's experts fused as gate_up_proj [E, 2 Im, H], gate rows
    first, and down_proj [E, H, Im])."""
    out, Im = {}, cfg["moe_intermediate_size"]
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu", torch.float32).contiguous()
        if name.endswith("rotary_emb.inv_freq") or "rotary_emb" in name:
            continue
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            if t.shape[1] != 2 * Im:
                die("%s has shape %s; expected [E, %d, H]" % (name, list(t.shape), 2 * Im))
            for e in range(t.shape[0]):
                out[base + "%d.gate_proj.weight" % e] = t[e, :Im].clone()
                out[base + "%d.up_proj.weight" % e] = t[e, Im:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[base + "%d.down_proj.weight" % e] = t[e].clone()
        else:
            out[name] = t
    want = set(expected_names(cfg))
    if set(out) != want:
        die("checkpoint names differ from the published layout: missing %s, unexpected %s"
            % (sorted(want - set(out))[:8], sorted(set(out) - want)[:8]))
    return out


# --------------------------------------------------------------------------
# training

def load_texts(tq6):
    d = os.path.join(tq6, "texts")
    files = sorted(f for f in os.listdir(d) if f.endswith(".txt")) if os.path.isdir(d) else []
    if not files:
        die("no texts in %s (tq6's calib_*.txt and eval_*.txt)" % d)
    data = []
    for f in files:
        with open(os.path.join(d, f), "rb") as fh:
            data.append(list(fh.read()))
    return data


def batch(texts, rng, n, length, device):
    rows = []
    for _ in range(n):
        t = texts[rng.randrange(len(texts))]
        start = rng.randrange(max(1, len(t) - length + 2))
        row = [BOS] + t[start:start + length - 1]
        row += [PAD] * (length - len(row))
        rows.append(row)
    x = torch.tensor(rows, dtype=torch.long, device=device)
    y = x[:, 1:].clone()
    y[y == PAD] = -100
    return x[:, :-1], y


def train(model, texts, a, device):
    rng = random.Random(a.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    model.train()
    t0, losses = time.time(), []
    for step in range(a.steps):
        lr = a.lr * (step + 1) / 30 if step < 30 else a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / a.steps)))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = batch(texts, rng, a.batch, a.seq + 1, device)
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if step % 50 == 0 or step == a.steps - 1:
            print("  step %4d  loss %.4f  lr %.2e  %.0f s" % (step, losses[-1], lr, time.time() - t0), flush=True)
    return losses, time.time() - t0


# --------------------------------------------------------------------------
# the router's choices: transformers' own, and the engine's rules

def indices_in(out, k):
    """The expert indices among a routing function's outputs: the integer
    tensor whose last dimension is top-k."""
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if torch.is_tensor(t) and not t.is_floating_point() and t.shape[-1] == k:
            return t
    die("the routing function returned no [tokens, %d] integer tensor: this transformers routes otherwise" % k)


class RouteTap:
    """Records, for every MoE block of a forward pass, its router logits and
    the experts transformers chose (route_tokens_to_experts in transformers 5;
    the gate's forward in 4.x)."""

    def __init__(self, blocks, k):
        self.blocks, self.k, self.saved, self.records = blocks, k, [], None

    def __enter__(self):
        self.records = [[] for _ in self.blocks]
        for i, mlp in enumerate(self.blocks):
            if hasattr(mlp, "route_tokens_to_experts"):
                orig = mlp.route_tokens_to_experts

                def wrapped(router_logits, _orig=orig, _i=i):
                    out = _orig(router_logits)
                    lg = router_logits.reshape(-1, router_logits.shape[-1])
                    idx = indices_in(out, self.k)
                    self.records[_i].append((lg.detach().float().cpu(), idx.reshape(lg.shape[0], -1).cpu()))
                    return out
                self.saved.append((mlp, "route_tokens_to_experts"))
                mlp.route_tokens_to_experts = wrapped
            else:
                gate, orig = mlp.gate, mlp.gate.forward

                def wrapped(hidden_states, _orig=orig, _gate=gate, _i=i):
                    out = _orig(hidden_states)
                    h = hidden_states.reshape(-1, _gate.weight.shape[1]).float()
                    lg = F.linear(h, _gate.weight.float())
                    idx = indices_in(out, self.k)
                    self.records[_i].append((lg.detach().cpu(), idx.reshape(lg.shape[0], -1).cpu()))
                    return out
                self.saved.append((gate, "forward"))
                gate.forward = wrapped
        return self

    def __exit__(self, *exc):
        for obj, attr in self.saved:   # the instance's wrapper goes; the class's method shows again
            del obj.__dict__[attr]
        self.saved = []


def engine_choice(cfg, logits, bias):
    """The choices the engine's router compares (docs/deepseek_moe.md):
    scores, the bias added under noaux_tc, the dropped groups set to 0.0;
    with the group ranks. logits: [T, E] float32."""
    E, G, kg = cfg["n_routed_experts"], cfg["n_group"], cfg["topk_group"]
    scores = torch.sigmoid(logits) if cfg["scoring_func"] == "sigmoid" else torch.softmax(logits, dim=-1)
    choice = scores + bias if cfg["topk_method"] == "noaux_tc" else scores.clone()
    rank = None
    if cfg["topk_method"] != "greedy" and G > 1 and kg < G:
        grouped = choice.view(-1, G, E // G)
        rank = grouped.topk(2, dim=-1)[0].sum(-1) if cfg["topk_method"] == "noaux_tc" else grouped.max(-1)[0]
        order = torch.sort(rank, dim=-1, descending=True, stable=True)[1]
        keep = torch.zeros_like(rank, dtype=torch.bool)
        keep.scatter_(1, order[:, :kg], True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // G, dim=1), 0.0)
    return choice, rank


def routes_and_margins(cfg, records, bias_per_layer):
    """Per MoE layer: transformers' experts (ascending) and the margin of the
    decision; fails when the engine's rules choose otherwise at a position
    that is not a near-tie."""
    k, kg = cfg["num_experts_per_tok"], cfg["topk_group"]
    ids, margins, disagreements, ties = [], [], 0, 0
    for m, recs in enumerate(records):
        logits = torch.cat([r[0] for r in recs])
        theirs = torch.cat([r[1] for r in recs]).sort(dim=-1)[0]
        bias = bias_per_layer[m] if bias_per_layer else torch.zeros(logits.shape[1])
        choice, rank = engine_choice(cfg, logits, bias)
        top = choice.sort(dim=-1, descending=True, stable=True)
        ours = top[1][:, :k].sort(dim=-1)[0]
        margin = top[0][:, k - 1] - top[0][:, k]
        if rank is not None:
            r = rank.sort(dim=-1, descending=True)[0]
            margin = torch.minimum(margin, r[:, kg - 1] - r[:, kg])
        if cfg["topk_method"] == "noaux_tc" and bool((top[0][:, :k] <= 0).any()):
            die("layer %d: a chosen expert's biased score is <= 0, so the 0.0 of the dropped groups competes and "
                "torch.topk's order of equal values decides: use a larger bias" % m)
        bad = (ours != theirs).any(-1)
        near = margin < MARGIN
        disagreements += int((bad & ~near).sum())
        ties += int(near.sum())
        ids.append(theirs)
        margins.append(margin)
    if disagreements:
        die("%d positions where transformers' experts differ from the engine's rules at a clear margin: "
            "docs/deepseek_moe.md does not describe this transformers" % disagreements)
    return torch.stack(ids, dim=1), torch.stack(margins, dim=1), ties


# --------------------------------------------------------------------------
# golden outputs in float32 (the CPU by default; --golden-device cuda runs
# them on the GPU with TF32 off, float32 products in another order)

@torch.no_grad()
def greedy(model, ids):
    dev = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=dev), use_cache=True)
    past, toks = getattr(out, "past_key_values", None), []
    logits = out.logits[0, -1]
    for i in range(GREEDY):
        tok = int(torch.argmax(logits))
        toks.append(tok)
        if i == GREEDY - 1:
            break
        if past is not None:
            out = model(input_ids=torch.tensor([[tok]], device=dev), past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[0, -1]
        else:
            logits = model(input_ids=torch.tensor([ids + toks], device=dev)).logits[0, -1]
    return toks


@torch.no_grad()
def golden(model, cfg, prompts):
    blocks = moe_blocks(model, cfg)
    bias = [b.gate.e_score_correction_bias.detach().float().cpu() for b in blocks] \
        if cfg["topk_method"] == "noaux_tc" else None
    tensors, ties, prompt_ties = {}, 0, 0
    dev = next(model.parameters()).device
    for p, ids in enumerate(prompts):
        t0 = time.time()
        x = torch.tensor([ids], device=dev)
        if len(ids) <= LOGIT_ROWS_CAP:
            tensors["p%d.logits_f32" % p] = model(input_ids=x).logits[0].float().cpu().contiguous()
        g = greedy(model, ids)
        seq = ids + g[:-1]
        with RouteTap(blocks, cfg["num_experts_per_tok"]) as tap:
            model(input_ids=torch.tensor([seq], device=dev))
        routes, margins, n_ties = routes_and_margins(cfg, tap.records, bias)
        if routes.shape[0] != len(seq):
            die("p%d: %d routed positions for %d tokens" % (p, routes.shape[0], len(seq)))
        ties += n_ties
        prompt_ties += int((margins[len(ids) - 1:] < MARGIN).sum())
        tensors["p%d.ids" % p] = torch.tensor(ids, dtype=torch.int32)
        tensors["p%d.greedy" % p] = torch.tensor(g, dtype=torch.int32)
        dt = torch.uint8 if cfg["n_routed_experts"] <= 256 else torch.int32
        tensors["p%d.routes" % p] = routes.to(dt).contiguous()
        tensors["p%d.route_margin" % p] = margins.float().contiguous()
        print("  p%d: %5d tokens, greedy %s..., %d near-tie routing decisions (%.1f s)"
              % (p, len(ids), g[:8], n_ties, time.time() - t0), flush=True)
    return tensors, ties, prompt_ties


def expert_use(model, cfg, texts):
    """How often each expert of each MoE layer is chosen over 4 x 512 tokens."""
    blocks = moe_blocks(model, cfg)
    counts = [[0] * cfg["n_routed_experts"] for _ in blocks]
    dev = next(model.parameters()).device
    with torch.no_grad(), RouteTap(blocks, cfg["num_experts_per_tok"]) as tap:
        for t in texts[:4]:
            model(input_ids=torch.tensor([[BOS] + t[:511]], device=dev))
    for m, recs in enumerate(tap.records):
        for _, idx in recs:
            for e in idx.reshape(-1).tolist():
                counts[m][e] += 1
    return counts


@torch.no_grad()
def check_reload(out_dir, model, model_cls, prompt):
    """The written checkpoint loads into transformers with nothing missing
    or unexpected and gives the trained model's logits."""
    try:
        back, info = model_cls.from_pretrained(out_dir, attn_implementation="eager", experts_implementation="eager",
                                               output_loading_info=True)
    except TypeError:
        back, info = model_cls.from_pretrained(out_dir, attn_implementation="eager", output_loading_info=True)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        die("transformers loading %s: %s" % (out_dir, bad))
    dev = next(model.parameters()).device
    a = model(input_ids=torch.tensor([prompt], device=dev)).logits.cpu()
    b = back.float().eval()(input_ids=torch.tensor([prompt])).logits
    d = float((a - b).abs().max())
    if d > 1e-5 * float(a.abs().max()):
        die("the reloaded checkpoint's logits differ by %.3g" % d)
    return d


# --------------------------------------------------------------------------

def bf16_exact(model):
    """Rounds every trained weight to its nearest BF16 value (kept in float32).
    The CUDA engine holds weights in BF16: with weights that BF16 represents
    exactly, its logits differ from the float32 golden ones by its arithmetic
    alone, not also by a rounding of every weight. The router bias is a buffer
    and stays as set (the engine reads it in float32)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))


def make(variant, a, texts, prompts, device, golden_device):
    import transformers
    print("%s: building (transformers %s, torch %s, %s)" % (variant, transformers.__version__, torch.__version__,
                                                            device), flush=True)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    cfg = model_config(variant)
    model, config, model_cls = build_model(cfg)
    blocks = moe_blocks(model, cfg)
    if cfg["topk_method"] == "group_limited_greedy":
        for mlp in blocks:   # some 5.x releases read an attribute their DeepseekV2Moe never sets
            if not hasattr(mlp, "num_experts"):
                mlp.num_experts = cfg["n_routed_experts"]
                print("  note: set DeepseekV2Moe.num_experts (group_limited_greedy reads it)")
    bias = set_router_bias(model, cfg)
    model.to(device)
    losses, seconds = train(model, texts, a, device)
    if not a.f32_weights:
        bf16_exact(model)
    model.to(golden_device).float().eval()
    if bias and [round(float(x), 6) for x in blocks[0].gate.e_score_correction_bias] != bias[0]:
        die("training moved e_score_correction_bias")
    counts = expert_use(model, cfg, texts)
    out_dir = os.path.join(a.out, variant)
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    cfg_out = dict(cfg, dtype="float32", transformers_version=transformers.__version__)
    cfg_out.pop("rope_theta" if int(transformers.__version__.split(".")[0]) >= 5 else "rope_parameters")
    for name, obj in (("config.json", cfg_out),
                      ("generation_config.json", {"bos_token_id": BOS, "eos_token_id": EOS, "pad_token_id": PAD})):
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
        written[name] = os.path.getsize(os.path.join(out_dir, name))
    written["model.safetensors"] = write_safetensors(os.path.join(out_dir, "model.safetensors"),
                                                     checkpoint_tensors(model, cfg), {"format": "pt"})
    reload_diff = check_reload(out_dir, model, model_cls, prompts[2])
    tensors, ties, prompt_ties = golden(model, cfg, prompts)
    meta = {"note": "ids include BOS; logits_f32 from float32 weights (every prompt up to %d tokens); greedy from "
                    "float32; routes[t][m][j]: the experts MoE layer m chose at position t of ids + greedy[:63], "
                    "ascending; route_margin[t][m]: the smallest gap of the choices that decided them"
                    % LOGIT_ROWS_CAP, "model": variant, "bos": str(BOS)}
    written["golden.safetensors"] = write_safetensors(os.path.join(out_dir, "golden.safetensors"), tensors, meta)
    info = {"name": variant, "steps": a.steps, "batch": a.batch, "seq_len": a.seq, "lr": a.lr, "seed": a.seed,
            "tokens": a.steps * a.batch * a.seq, "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(seconds, 1), "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
            "first_loss": round(losses[0], 4), "expert_use_per_layer": counts,
            "e_score_correction_bias": bias or None, "near_tie_decisions": ties,
            "near_tie_decisions_replayed": prompt_ties, "reload_max_logit_diff": reload_diff,
            "torch": torch.__version__, "transformers": transformers.__version__, "device": str(device),
            "golden_device": str(golden_device), "weights": "float32" if a.f32_weights else "bf16-exact",
            "corpus": "tq6 texts (calib_*.txt, eval_*.txt)"}
    with open(os.path.join(out_dir, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    written["train_info.json"] = os.path.getsize(os.path.join(out_dir, "train_info.json"))
    for name, size in sorted(written.items()):
        print("%s: wrote %s (%d bytes)" % (variant, os.path.join(out_dir, name), size))
    print("%s: loss %.3f -> %.3f, expert use of the last layer %s" % (variant, info["first_loss"], info["final_loss"],
                                                                      counts[-1]))
    if max(counts[-1]) < 2 * sum(counts[-1]) / len(counts[-1]):
        print("%s: warning: the last layer's router is nearly uniform" % variant)
    return sum(written.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tq6", default="../shared/models/tq6", help="tq6's folder (texts/, golden.safetensors)")
    ap.add_argument("--out", default="../shared/models", help="where the model folders go (OUT/dsmoe, OUT/dsmoe2)")
    ap.add_argument("--variant", choices=["dsmoe", "dsmoe2", "both"], default="both")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="training device")
    ap.add_argument("--f32-weights", action="store_true",
                    help="keep the trained float32 weights (default: rounded to BF16 values, see bf16_exact)")
    ap.add_argument("--golden-device", default="cpu",
                    help="where the float32 golden outputs are computed: cpu (default) or the GPU (cuda; TF32 off)")
    a = ap.parse_args()
    if a.device.startswith("cuda") or a.golden_device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    gold = os.path.join(a.tq6, "golden.safetensors")
    if not os.path.isfile(gold):
        die("%s not found (tq6's golden prompts)" % gold)
    ints = read_safetensors_ints(gold)
    prompts = [ints.get("p%d.ids" % p) for p in range(7)]
    if any(x is None for x in prompts):
        die("%s lacks some of p0.ids .. p6.ids" % gold)
    texts = load_texts(a.tq6)
    total = 0
    for v in (["dsmoe", "dsmoe2"] if a.variant == "both" else [a.variant]):
        total += make(v, a, texts, prompts, torch.device(a.device), torch.device(a.golden_device))
    print("train_dsmoe: %d bytes written in all" % total)
    if total > MAX_BYTES:
        die("the outputs take %d bytes, more than %d" % (total, MAX_BYTES))


if __name__ == "__main__":
    main()
