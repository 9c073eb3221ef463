#!/usr/bin/env python3
"""Trains a small byte-level Qwen3 on the synthetic retrieval tasks of
retrieval_tasks.py, for the task-accuracy comparison of KV cache formats
(docs/eval_task.md; models/retrieval/README.md is its card).

The model is transformers' Qwen3ForCausalLM with the byte tokenizer of the
project's test models (ids 0..255 bytes, 256 BOS, 257 EOS, 258 PAD,
vocabulary 272). A training example is BOS, a prompt of the train split, its
answer and a newline; the loss falls on the answer and the newline only.
The curriculum runs stages of growing context (bytes per prompt), each a
number of optimizer steps at a constant number of tokens per batch, under
one warm-up and cosine decay. At the end of every stage it prints greedy
exact-match accuracy on held-out prompts of that context and of the
longest one (transformers' generate, the same scoring as eval-task).

    python3 models/retrieval/train_retrieval.py --out ../shared/models/retrieval
    python3 models/retrieval/train_retrieval.py --out /tmp/r --stages 512:20,1024:20 --eval-n 8   # a quick check

writes into --out the Hugging Face folder fp4rollout loads (config.json,
generation_config.json, model.safetensors in BF16), train_info.json with
the accuracies, and train_state.pt, the float32 state, optimizer and
position of the run, saved every --save-every steps and at each stage's
end: the same command with --resume continues where it stopped, on the
same batches. Needs PyTorch and transformers; one GPU (the CPU works, very
slowly).
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import retrieval_tasks as rt  # noqa: E402  (beside this script; no torch)

VOCAB = 272


def die(msg):
    print("train_retrieval: " + msg, file=sys.stderr)
    sys.exit(1)


def model_config(a):
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
        "hidden_size": a.hidden, "intermediate_size": a.intermediate, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
        "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": a.rope_theta,
        "max_position_embeddings": a.max_position, "attention_bias": False, "tie_word_embeddings": False,
        "bos_token_id": rt.BOS, "eos_token_id": rt.EOS, "pad_token_id": rt.PAD, "use_sliding_window": False,
    }


def build_model(cfg):
    import transformers
    from transformers import Qwen3Config, Qwen3ForCausalLM
    c = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    if int(transformers.__version__.split(".")[0]) >= 5:   # 5.x keeps the RoPE base in rope_parameters
        c["rope_parameters"] = {"rope_type": "default", "rope_theta": c.pop("rope_theta")}
    model = Qwen3ForCausalLM(Qwen3Config(**c))
    theta = getattr(model.config, "rope_theta", None) or model.config.rope_parameters["rope_theta"]
    if theta != cfg["rope_theta"]:
        die("transformers %s did not take the RoPE base (%r)" % (transformers.__version__, theta))
    return model


def parse_stages(text):
    stages = []
    for part in text.split(","):
        ctx, _, steps = part.partition(":")
        if not ctx.isdigit() or not steps.isdigit() or int(steps) < 1:
            die("--stages takes CONTEXT:STEPS,... (got %r)" % part)
        stages.append((int(ctx), int(steps)))
    return stages


def lr_at(step, total, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, total - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def loss_of(model, batch, device):
    ids = torch.tensor([i for i, _ in batch], dtype=torch.long, device=device)
    mask = torch.tensor([m for _, m in batch], dtype=torch.float32, device=device)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        logits = model(input_ids=ids[:, :-1]).logits
    ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1)
    return (ce * m).sum() / m.sum()


@torch.no_grad()
def accuracy(model, a, context, device):
    """Greedy exact match on held-out prompts of every variant at context."""
    model.eval()
    out = {}
    for variant in a.variants:
        right = 0
        for i in range(a.eval_n):
            t = rt.make_task(a.seed, "heldout", variant, context, i)
            ids = torch.tensor([[rt.BOS] + list(t["prompt"].encode())], device=device)
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                     max_new_tokens=len(t["answer"]) + 8, eos_token_id=[rt.EOS, 10],
                                     pad_token_id=rt.PAD)
            text = bytes(x for x in gen[0, ids.shape[1]:].tolist() if x < 256).decode(errors="replace")
            right += text.split("\n")[0].strip(" \t\r") == t["answer"].strip(" \t\r")
        out[variant] = right / a.eval_n
    model.train()
    return out


def save_state(path, model, opt, stage, step, total_step, history, a):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "stage": stage, "step": step,
                "total_step": total_step, "history": history, "args": vars(a)}, tmp)
    os.replace(tmp, path)   # a run killed while saving keeps the previous state


def export(model, cfg, a, history, seconds):
    import transformers
    out = a.out
    try:
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    except TypeError:   # releases that write safetensors only take no such argument
        model.to(torch.bfloat16).save_pretrained(out)
    model.float()
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": rt.BOS, "eos_token_id": rt.EOS, "pad_token_id": rt.PAD}, f, indent=2)
        f.write("\n")
    info = {"config": cfg, "stages": a.stages, "tokens_per_batch": a.batch_tokens, "lr": a.lr, "seed": a.seed,
            "variants": a.variants, "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(seconds, 1), "heldout_accuracy": history, "torch": torch.__version__,
            "transformers": transformers.__version__}
    with open(os.path.join(out, "train_info.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    for name in ("config.json", "model.safetensors", "generation_config.json", "train_info.json"):
        if not os.path.exists(os.path.join(out, name)):
            die("%s was not written" % os.path.join(out, name))


def train(model, a, device, stages, state):
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stage0, step0, total_step, history = 0, 0, 0, []
    if state:
        opt.load_state_dict(state["opt"])
        stage0, step0, total_step, history = state["stage"], state["step"], state["total_step"], state["history"]
    total = sum(s for _, s in stages)
    path = os.path.join(a.out, "train_state.pt")
    t0 = time.time()
    for si in range(stage0, len(stages)):
        context, steps = stages[si]
        batch = max(1, a.batch_tokens // (context + 64))
        data = rt.train_batches(a.seed, a.variants, context, batch, start=step0 if si == stage0 else 0)
        for step in range(step0 if si == stage0 else 0, steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(total_step, total, a)
            loss = loss_of(model, next(data), device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total_step += 1
            if step % a.log_every == 0:
                print("stage %d (context %d, batch %d) step %d/%d loss %.4f lr %.2e %.0f s" % (
                    si, context, batch, step, steps, loss.item(), lr_at(total_step, total, a), time.time() - t0),
                    flush=True)
            if a.save_every and total_step % a.save_every == 0:
                save_state(path, model, opt, si, step + 1, total_step, history, a)
        acc = {"stage": si, "context": context, "accuracy": accuracy(model, a, context, device)}
        longest = stages[-1][0]
        if longest != context:
            acc["accuracy_at_%d" % longest] = accuracy(model, a, longest, device)
        history.append(acc)
        print("held-out greedy exact match after stage %d: %s" % (si, json.dumps(acc)), flush=True)
        save_state(path, model, opt, si + 1, 0, total_step, history, a)
    return history, time.time() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the model folder (and the run's train_state.pt)")
    ap.add_argument("--stages", default="512:400,1024:400,2048:600,4096:800,8192:800,16384:1000",
                    help="the curriculum: CONTEXT:STEPS,... (context in bytes of prompt)")
    ap.add_argument("--variants", default=",".join(rt.VARIANTS))
    ap.add_argument("--batch-tokens", type=int, default=131072, help="tokens per optimizer step (about)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128,
                    help="128: the CUDA FP4/FP8 decode kernels are built for it")
    ap.add_argument("--rope-theta", type=float, default=1000000.0)
    ap.add_argument("--max-position", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out prompts per variant at each stage's end")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=200, help="steps between train_state.pt saves (0: stage ends)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/train_state.pt")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    a.variants = [v for v in a.variants.split(",") if v]
    if any(v not in rt.VARIANTS for v in a.variants):
        die("--variants: one of %s" % ", ".join(rt.VARIANTS))
    stages = parse_stages(a.stages)
    if a.head_dim != 128:
        print("train_retrieval: warning: head_dim %d: the CUDA FP4/FP8 decode kernels take 128 only" % a.head_dim)
    if max(c for c, _ in stages) + 64 > a.max_position:
        die("--max-position %d is below the longest stage's context" % a.max_position)
    os.makedirs(a.out, exist_ok=True)
    state = None
    if a.resume:
        path = os.path.join(a.out, "train_state.pt")
        if not os.path.exists(path):
            die("--resume: %s does not exist" % path)
        state = torch.load(path, map_location="cpu")
        for k in ("stages", "seed", "variants", "batch_tokens", "hidden", "layers", "heads", "kv_heads", "head_dim"):
            if state["args"][k] != getattr(a, k):
                die("--resume: --%s differs from the saved run's (%r)" % (k.replace("_", "-"), state["args"][k]))
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    cfg = model_config(a)
    model = build_model(cfg)
    if state:
        model.load_state_dict(state["model"])
    model.to(device).train()
    print("model: %d parameters, %s; stages %s" % (sum(p.numel() for p in model.parameters()), device, stages))
    history, seconds = train(model, a, device, stages, state)
    export(model.to("cpu"), cfg, a, history, seconds)
    print("wrote %s (config.json, model.safetensors, generation_config.json, train_info.json)" % a.out)


if __name__ == "__main__":
    main()
