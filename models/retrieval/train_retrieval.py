#!/usr/bin/env python3
"""Trains a small byte-level Qwen3 on the synthetic retrieval tasks of
retrieval_tasks.py, for the task-accuracy comparison of KV cache formats
(docs/eval_task.md; models/retrieval/README.md is its card).

The model is the project's plain-PyTorch Qwen3 (models/torch_qwen3/qwen3.py)
with the byte tokenizer of the project's test models (ids 0..255 bytes, 256
BOS, 257 EOS, 258 PAD, vocabulary 272). A training example is BOS, a prompt
of the train split, its answer and a newline; the loss falls on the answer
and the newline only (with --drills N, single and multikey prompts of the
train split also hold N answered questions before the final one, and their
answers are in the loss too). The curriculum runs stages of growing context (bytes
per prompt), each a number of optimizer steps at about --batch-tokens tokens
a step or a batch of its own, under one warm-up and cosine decay; a stage
that repeats a context draws new prompts. At the end of every
stage it prints greedy exact-match accuracy on held-out prompts of that
context and of the longest one (the same scoring as eval-task).

    python3 models/retrieval/train_retrieval.py --out ../shared/models/retrieval
    python3 models/retrieval/train_retrieval.py --out /tmp/r --stages 512:20,1024:20 --eval-n 8   # a quick check

writes into --out the Hugging Face folder fp4rollout loads (config.json,
generation_config.json, model.safetensors in BF16), train_info.json with
the accuracies, and train_state.pt, the float32 weights, optimizer and
position of the run, saved every --save-every steps, at each stage's end
and at --stop-after (steps) or --stop-after-minutes (this invocation's wall
time, for runs cut into calls of limited length): the same command with
--resume continues where it stopped, on the same batches. A stop also
writes OUT/handoff/ (the weights in BF16 and the run's position, a sixth of
train_state.pt's size): where only that travels to another machine,
--resume goes on from it with a fresh optimizer, re-warmed over --rewarm
steps (the same batches, no longer bitwise the same run). Needs PyTorch (Debian's 1.13 or later); on a
GPU BF16 autocast, on the CPU float32. --check-transformers also needs
transformers: it loads the written folder into transformers'
Qwen3ForCausalLM and compares its logits with this model's.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "torch_qwen3"))
import retrieval_tasks as rt  # noqa: E402  (beside this script; no torch)
from qwen3 import (VOCAB, byte_model_config, greedy_cached, load_policy, load_state_file, new_model,  # noqa: E402
                   read_safetensors, save_checkpoint, save_safetensors, save_state_file)

# The recipe that learned the lookup on a GPU (models/retrieval/README.md): three records
# (200 bytes) first, then growing contexts, 6,000 steps each in evaluated thirds; past 768
# bytes not yet run.
DEFAULT_STAGES = ",".join(["%d:2000" % c for c in (200, 300, 400, 512, 768, 1024, 1536, 2048) for _ in range(3)] +
                          ["%d:2000:%d" % (c, b) for c, b in ((3072, 4), (4096, 3), (6144, 2), (8192, 2)) for _ in range(2)])
# What decides the weights and the batches: a resumed run must share them.
SAME_ON_RESUME = ("stages", "variants", "batch_tokens", "hidden", "intermediate", "layers", "heads", "kv_heads",
                  "head_dim", "rope_theta", "max_position", "lr", "warmup", "seed", "drills")
# Keys that runs saved before they existed lack, with the value those runs had.
SAVED_BEFORE = {"drills": 0}


def die(msg):
    print("train_retrieval: " + msg, file=sys.stderr)
    sys.exit(1)


def parse_stages(text):
    """[(context, steps, batch)]: batch 0 where the stage leaves it to --batch-tokens."""
    stages = []
    for part in text.split(","):
        f = part.split(":")
        if len(f) not in (2, 3) or not all(x.isdigit() for x in f) or int(f[1]) < 1 or (len(f) == 3 and int(f[2]) < 1):
            die("--stages takes CONTEXT:STEPS or CONTEXT:STEPS:BATCH,... (got %r)" % part)
        stages.append((int(f[0]), int(f[1]), int(f[2]) if len(f) == 3 else 0))
    return stages


def stages_text(stages):
    return ",".join("%d:%d" % s[:2] + (":%d" % s[2] if s[2] else "") for s in stages)


def batch_of(stage, a):
    """Prompts per step of a stage: its own, else about --batch-tokens tokens."""
    context, _, batch = stage
    return batch or max(1, a.batch_tokens // (context + 64))


def drawn_before(stages, si, a):
    """Training prompts the stages before si drew at si's context: a stage
    that repeats a context goes on with new prompts instead of the same ones."""
    return sum(st[1] * batch_of(st, a) for st in stages[:si] if st[0] == stages[si][0])


def lr_at(step, total, a):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    t = (step - a.warmup) / max(1, total - a.warmup)
    return a.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def autocast(device):
    """BF16 autocast on a GPU; float32 elsewhere (the CPU's BF16 is slow and
    would make the CPU runs' results depend on its kernels)."""
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")


def loss_of(model, batch, device):
    ids = torch.tensor([i for i, _ in batch], dtype=torch.long, device=device)
    mask = torch.tensor([m for _, m in batch], dtype=torch.float32, device=device)
    with autocast(device):
        logits = model(ids[:, :-1])
    ce = F.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1)
    return (ce * m).sum() / m.sum()


def answer_of(model, task, device):
    """The model's greedy answer to a task, scored as eval-task scores: the
    text up to the first newline, spaces, tabs and carriage returns trimmed."""
    ids = [rt.BOS] + list(task["prompt"].encode())
    with autocast(device):
        gen = greedy_cached(model, ids, len(task["answer"].encode()) + 8, stop_ids=(rt.EOS, 10))
    text = bytes(x for x in gen if x < 256).decode(errors="replace")
    return text.split("\n")[0].strip(" \t\r")


def accuracy(model, a, context, device):
    """Greedy exact match on held-out prompts of every variant at context."""
    out = {}
    for variant in a.variants:
        right = 0
        for i in range(a.eval_n):
            t = rt.make_task(a.seed, "heldout", variant, context, i)
            right += answer_of(model, t, device) == t["answer"].strip(" \t\r")
        out[variant] = right / a.eval_n
    return out


def save_handoff(model, pos, history, seconds, a):
    """OUT/handoff: the BF16 weights and the position of the next step, what a
    run needs to go on elsewhere without train_state.pt (its optimizer starts
    afresh there)."""
    d = os.path.join(a.out, "handoff")
    os.makedirs(d, exist_ok=True)
    save_safetensors(model.state_dict(), os.path.join(d, "weights.safetensors"), "BF16")
    write_json(os.path.join(d, "position.json"), {"stage": pos[0], "step": pos[1], "total_step": pos[2],
                                                 "history": history, "seconds": seconds,
                                                 "args": {k: getattr(a, k) for k in SAME_ON_RESUME}})


def save_state(path, model, opt, pos, history, seconds, a):
    """pos: (stage, step within it, steps of the whole run) of the next step."""
    save_state_file({"model": model.state_dict(), "opt": opt.state_dict(), "stage": pos[0], "step": pos[1],
                     "total_step": pos[2], "history": history, "seconds": seconds, "args": vars(a)}, path)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def export(model, cfg, a, history, seconds, total_step, out=None, finished=True):
    """The loadable folder: a.out at the run's end; out (OUT/snapshot) for a
    stopped run's --snapshot, with finished false."""
    out = out or a.out
    os.makedirs(out, exist_ok=True)
    save_checkpoint(model, cfg, out, "BF16")
    info = {"finished": finished, "config": cfg, "stages": a.stages, "tokens_per_batch": a.batch_tokens, "lr": a.lr,
            "warmup": a.warmup, "seed": a.seed, "variants": a.variants, "steps": total_step,
            "params": sum(p.numel() for p in model.parameters()), "train_seconds": round(seconds, 1),
            "heldout_accuracy": history, "eval_n": a.eval_n, "torch": torch.__version__, "device": a.device,
            "threads": torch.get_num_threads()}
    write_json(os.path.join(out, "train_info.json"), info)


def stage_end(model, a, stages, si, device, history):
    context = stages[si][0]
    model.eval()
    acc = {"stage": si, "context": context, "accuracy": accuracy(model, a, context, device)}
    longest = stages[-1][0]
    if longest != context:
        acc["accuracy_at_%d" % longest] = accuracy(model, a, longest, device)
    model.train()
    history.append(acc)
    print("held-out greedy exact match after stage %d: %s" % (si, json.dumps(acc)), flush=True)


def train(model, a, device, stages, state):
    """Runs the curriculum from the state's position (or the start). Returns
    (finished, history, seconds, steps done): finished False when --stop-after
    or --stop-after-minutes stopped it (the state saved at a step's end)."""
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
    stage0, step0, total_step, history, seconds0 = 0, 0, 0, [], 0.0
    if state:
        if state.get("opt") is not None:
            opt.load_state_dict(state["opt"])
        stage0, step0, total_step = state["stage"], state["step"], state["total_step"]
        history, seconds0 = state["history"], state.get("seconds", 0.0)
    # from a handoff the optimizer starts afresh: its learning rate climbs back over --rewarm steps
    rewarm_from = total_step if state and state.get("opt") is None else None
    total = sum(st[1] for st in stages)
    path = os.path.join(a.out, "train_state.pt")
    t0 = time.time()

    def stop_at(step_total):
        return step_total == a.stop_after or (a.stop_after_minutes > 0 and time.time() - t0 >= 60 * a.stop_after_minutes)

    for si in range(stage0, len(stages)):
        context, steps, _ = stages[si]
        batch = batch_of(stages[si], a)
        first = step0 if si == stage0 else 0
        data = rt.train_batches(a.seed, a.variants, context, batch, start=first, offset=drawn_before(stages, si, a),
                                drills=a.drills)
        for step in range(first, steps):
            lr = lr_at(total_step, total, a)
            if rewarm_from is not None and total_step - rewarm_from < a.rewarm:
                lr *= (total_step - rewarm_from + 1) / a.rewarm
            for g in opt.param_groups:
                g["lr"] = lr
            loss = loss_of(model, next(data), device)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            total_step += 1
            if step % a.log_every == 0 or step + 1 == steps:
                print("stage %d (context %d, batch %d) step %d/%d loss %.4f lr %.2e %.0f s" % (
                    si, context, batch, step + 1, steps, loss.item(), lr_at(total_step - 1, total, a),
                    seconds0 + time.time() - t0), flush=True)
            last = step + 1 == steps
            stop = stop_at(total_step) and not last
            if (a.save_every and total_step % a.save_every == 0 and not last) or stop:
                save_state(path, model, opt, (si, step + 1, total_step), history, seconds0 + time.time() - t0, a)
            if stop:
                save_handoff(model, (si, step + 1, total_step), history, seconds0 + time.time() - t0, a)
                return False, history, seconds0 + time.time() - t0, total_step
        stage_end(model, a, stages, si, device, history)
        save_state(path, model, opt, (si + 1, 0, total_step), history, seconds0 + time.time() - t0, a)
        if stop_at(total_step) and si + 1 < len(stages):
            save_handoff(model, (si + 1, 0, total_step), history, seconds0 + time.time() - t0, a)
            return False, history, seconds0 + time.time() - t0, total_step
    return True, history, seconds0 + time.time() - t0, total_step


def transformers_class():
    """transformers' Qwen3ForCausalLM, or a clear exit when it is not importable."""
    try:
        import transformers
        return transformers, transformers.Qwen3ForCausalLM
    except (ImportError, AttributeError) as e:
        die("--check-transformers needs transformers with Qwen3 (pip install transformers): %s" % e)


def check_transformers(a, stages, device):
    """Loads the written folder into transformers' Qwen3ForCausalLM and into
    this script's model, both float32, and compares their logits on one
    held-out prompt per variant at the first and the longest context."""
    transformers, cls = transformers_class()
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    hf, info = cls.from_pretrained(a.out, output_loading_info=True, **kw)
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        die("--check-transformers: transformers %s loads %s with %s" % (transformers.__version__, a.out, bad))
    theta = getattr(hf.config, "rope_theta", None) or (hf.config.rope_parameters or {}).get("rope_theta")
    if theta != a.rope_theta:
        die("--check-transformers: transformers %s took RoPE base %r, the folder says %r" % (
            transformers.__version__, theta, a.rope_theta))
    ours = load_policy(a.out).to(device).eval()
    hf = hf.to(device).eval()
    worst = 0.0
    for context in sorted({stages[0][0], stages[-1][0]}):
        for variant in a.variants:
            t = rt.make_task(a.seed, "heldout", variant, context, 0)
            ids = torch.tensor([[rt.BOS] + list(t["prompt"].encode())], device=device)
            with torch.no_grad():
                ref = hf(input_ids=ids).logits[0].float()
                got = ours(ids)[0].float()
            err = float((got - ref).abs().max() / ref.abs().max())
            print("check-transformers: %s at %d: max |logit error| / max |logit| %.2e" % (variant, context, err))
            worst = max(worst, err)
    if worst > a.check_tol:
        die("--check-transformers: logits differ from transformers' by %.2e of the largest (limit %g)" % (
            worst, a.check_tol))
    print("check-transformers: transformers %s agrees within %.2e (limit %g)" % (
        transformers.__version__, worst, a.check_tol))


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the model folder (and the run's train_state.pt)")
    ap.add_argument("--stages", default=DEFAULT_STAGES,
                    help="the curriculum: CONTEXT:STEPS[:BATCH],... (context in bytes of prompt; BATCH prompts a "
                         "step, else about --batch-tokens tokens); default: three records (200 bytes) grown to 8K")
    ap.add_argument("--variants", default="single",
                    help="of %s (multikey needs stages of 272 bytes or more, vartrack 324)" % ",".join(rt.VARIANTS))
    ap.add_argument("--drills", type=int, default=0,
                    help="answered questions on random records before a single or multikey prompt's final one, "
                         "each answer supervised (denser signal for learning the lookup; held-out prompts have none)")
    ap.add_argument("--batch-tokens", type=int, default=8192, help="tokens per optimizer step (about)")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1152)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128,
                    help="128: the CUDA FP4/FP8 decode kernels are built for it")
    ap.add_argument("--rope-theta", type=float, default=1000000.0)
    ap.add_argument("--max-position", type=int, default=32768)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out prompts per variant at each stage's end")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--save-every", type=int, default=200, help="steps between train_state.pt saves (0: stage ends)")
    ap.add_argument("--stop-after", type=int, default=0,
                    help="stop after this many optimizer steps of the whole run, the state saved and nothing "
                         "exported (--resume continues); 0: run to the end")
    ap.add_argument("--stop-after-minutes", type=float, default=0.0,
                    help="stop at the first step's end (or stage's end) past this many minutes of this invocation, "
                         "the state saved (--resume continues); 0: no limit")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/train_state.pt, or without it from OUT/handoff (a stop's BF16 weights and "
                         "position) with a fresh optimizer")
    ap.add_argument("--snapshot", action="store_true",
                    help="at a stop, also write OUT/snapshot/, the weights so far as a model folder fp4rollout "
                         "loads (train_info.json says finished: false)")
    ap.add_argument("--rewarm", type=int, default=50,
                    help="steps over which a resume from OUT/handoff brings the learning rate back")
    ap.add_argument("--threads", type=int, default=0, help="CPU threads of PyTorch (0: its default)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--check-transformers", action="store_true",
                    help="after writing the folder, compare transformers' logits with this model's (needs "
                         "transformers)")
    ap.add_argument("--check-tol", type=float, default=1e-3,
                    help="--check-transformers' largest logit error, relative to the largest logit")
    return ap.parse_args()


def check_args(a, stages):
    if not a.variants or any(v not in rt.VARIANTS for v in a.variants):
        die("--variants: one or more of %s" % ", ".join(rt.VARIANTS))
    if a.head_dim != 128:
        print("train_retrieval: warning: head_dim %d: the CUDA FP4/FP8 decode kernels take 128 only" % a.head_dim)
    if max(st[0] for st in stages) + 64 > a.max_position:
        die("--max-position %d is below the longest stage's context" % a.max_position)
    if a.drills < 0:
        die("--drills takes a number >= 0")
    for context, *_ in stages:
        for v in a.variants:
            try:
                rt.make_task(a.seed, "train", v, context, 0, drills=a.drills)
            except ValueError as e:
                die("--stages: %s: %s" % (v, e))
    if a.stop_after < 0 or a.threads < 0 or a.stop_after_minutes < 0 or a.rewarm < 1:
        die("--stop-after, --stop-after-minutes and --threads take a number >= 0, --rewarm one >= 1")
    if a.check_transformers:
        transformers_class()   # refused now rather than after the training


def load_handoff(a):
    """OUT/handoff as a state without an optimizer: the BF16 weights as float32."""
    d = os.path.join(a.out, "handoff")
    with open(os.path.join(d, "position.json")) as f:
        pos = json.load(f)
    weights = {k: v.float() for k, v in read_safetensors(os.path.join(d, "weights.safetensors")).items()}
    print("--resume: no train_state.pt; going on from %s at step %d with a fresh optimizer, the learning rate "
          "re-warmed over %d steps" % (d, pos["total_step"], a.rewarm), flush=True)
    return {"model": weights, "opt": None, "stage": pos["stage"], "step": pos["step"],
            "total_step": pos["total_step"], "history": pos["history"], "seconds": pos["seconds"],
            "args": pos["args"]}


def load_state(a):
    path = os.path.join(a.out, "train_state.pt")
    if os.path.exists(path):
        state = load_state_file(path, "cpu")
    elif os.path.exists(os.path.join(a.out, "handoff", "position.json")):
        state = load_handoff(a)
    else:
        die("--resume: %s does not exist (nor a handoff folder)" % path)
    for k in SAME_ON_RESUME:
        saved = state["args"].get(k, SAVED_BEFORE.get(k))
        if k == "stages" and saved != a.stages:
            check_stages_extend(parse_stages(saved), parse_stages(a.stages), state["stage"], state["step"])
        elif saved != getattr(a, k):
            die("--resume: --%s %r differs from the saved run's (%r)" % (k.replace("_", "-"), getattr(a, k), saved))
    return state


def check_stages_extend(saved, new, stage, step):
    """A resumed run may change the stages it has not reached: the ones done and
    the current one's context stay, the current one may not end before the
    position. The learning rate's cosine then follows the new total."""
    done = saved[:stage]
    if new[:stage] != done or (stage < len(saved) and (len(new) <= stage or new[stage][0] != saved[stage][0]
                                                       or new[stage][1] < step)):
        die("--resume: --stages may change only the stages not yet reached (the run is at stage %d, step %d of %s)"
            % (stage, step, stages_text(saved)))
    print("--resume: the stages after stage %d change: %d steps in all instead of %d" % (
        stage, sum(st[1] for st in new), sum(st[1] for st in saved)), flush=True)


def main():
    a = parse_args()
    a.variants = [v for v in a.variants.split(",") if v]
    stages = parse_stages(a.stages)
    check_args(a, stages)
    if a.threads:
        torch.set_num_threads(a.threads)
    os.makedirs(a.out, exist_ok=True)
    state = load_state(a) if a.resume else None
    if state and a.stop_after and a.stop_after <= state["total_step"]:
        die("--stop-after %d: the saved run is at step %d already" % (a.stop_after, state["total_step"]))
    torch.manual_seed(a.seed)
    device = torch.device(a.device)
    cfg = byte_model_config(a.hidden, a.intermediate, a.layers, a.heads, a.kv_heads, a.head_dim, a.max_position,
                            a.rope_theta)
    model = new_model(cfg)
    if state:
        model.load_state_dict(state["model"])
    model.to(device).train()
    print("model: %d parameters, %s, %d threads; stages %s" % (
        sum(p.numel() for p in model.parameters()), device, torch.get_num_threads(),
        ",".join("%d:%d:%d" % (st[0], st[1], batch_of(st, a)) for st in stages)), flush=True)
    finished, history, seconds, steps = train(model, a, device, stages, state)
    if not finished:
        print("stopped after %d steps (%s); --resume continues" % (
            steps, "--stop-after" if steps == a.stop_after else "--stop-after-minutes"))
        if a.snapshot:
            snap = os.path.join(a.out, "snapshot")
            export(model.to("cpu"), cfg, a, history, seconds, steps, out=snap, finished=False)
            print("wrote %s: the weights at step %d as a model folder" % (snap, steps), flush=True)
        return
    export(model.to("cpu"), cfg, a, history, seconds, steps)
    print("wrote %s (config.json, model.safetensors, generation_config.json, train_info.json)" % a.out, flush=True)
    if a.check_transformers:
        check_transformers(a, stages, device)


if __name__ == "__main__":
    main()
