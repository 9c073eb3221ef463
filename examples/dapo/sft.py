"""Supervised warm-up for the arithmetic task: fine-tunes a checkpoint (tq6
by default) on worked solutions of arith_task.py, the loss on the solution
only, and writes a checkpoint folder `fp4rollout serve` serves and train.py
starts from.

    python3 examples/dapo/sft.py --out runs/sft --steps 1500 --batch 16 --device cuda

OUT/ gets config.json, generation_config.json and model.safetensors in
float32 (the optimizer's small steps survive, and the trainer's policy, the
server's version 0 and the float32 weight pushes all start from the same
numbers), texts/calib_*.txt (worked problems of the same sizes, for
`fp4rollout calibrate`), sft_log.csv (loss per step) and sft_eval.json
(held-out accuracy, greedy and with one sample at temperature 1).
OUT/sft_state.pt holds what a resumed run needs (model, optimizer, step;
the data of step s follows from (seed, s) alone); --resume continues from
it (a finished run only evaluates again), and --time-limit-s stops cleanly
before a step that would pass the limit.
"""
import argparse
import csv
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "models", "torch_qwen3"))

import torch  # noqa: E402

from arith_task import EOS, check, completion_text, problems  # noqa: E402
from dapo import token_logprobs  # noqa: E402
from qwen3 import greedy_batch, load_policy, load_state_file, save_checkpoint, save_state_file  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "..", "shared", "models", "tq6"),
                    help="the starting checkpoint (default ../shared/models/tq6)")
    ap.add_argument("--out", required=True, help="the warm-up checkpoint folder (created)")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=16, help="problems per step")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="problems per forward pass, gradients accumulated (0: the whole batch at once)")
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup-steps", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--operands", type=int, default=8)
    ap.add_argument("--digits", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=64, help="held-out problems scored at the end (greedy, and sampled)")
    ap.add_argument("--eval-batch", type=int, default=32)
    ap.add_argument("--save-every", type=int, default=200, help="steps between resumable states (0: at the end)")
    ap.add_argument("--time-limit-s", type=float, default=0,
                    help="stop before a step that would end past this many seconds (judged by the slowest "
                         "step so far); the state is saved and the checkpoint written (0: none)")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/sft_state.pt")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    return ap.parse_args(argv)


def lr_at(args, step):
    """Linear warm-up, then linear decay to a tenth."""
    if args.warmup_steps > 0 and step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    frac = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    return args.lr * (1.0 - 0.9 * min(1.0, frac))


def backward_batch(policy, args, step):
    """The gradient of step's token-mean loss, `--micro-batch` problems per
    forward; returns the loss."""
    ps = problems(args.seed, "sft-train", args.batch, args.operands, args.digits, start=step * args.batch)
    seqs = [p.token_ids + list(p.solution.encode()) + [EOS] for p in ps]
    plens = [len(p.token_ids) for p in ps]
    tokens = float(sum(len(s) - n for s, n in zip(seqs, plens)))
    micro = args.micro_batch if args.micro_batch > 0 else len(seqs)
    total = 0.0
    for i in range(0, len(seqs), micro):
        logp, mask = token_logprobs(policy, seqs[i:i + micro], plens[i:i + micro])
        loss = -(logp * mask).sum() / tokens
        loss.backward()
        total += float(loss)
    return total


def evaluate(policy, args):
    """Held-out accuracy: greedy, and one sample per problem at temperature 1
    (what RL's groups see). {n, accuracy, answer_found, lines_right,
    sampled_accuracy, sampled_lines_right, solution_bytes_mean, ...}."""
    ps = problems(args.seed, "sft-heldout", args.eval_n, args.operands, args.digits)
    max_new = max(len(p.solution) for p in ps) + 32
    gen = torch.Generator().manual_seed(args.seed)
    greedy, sampled = [], []
    for i in range(0, len(ps), args.eval_batch):
        chunk = ps[i:i + args.eval_batch]
        for temp, res in ((0.0, greedy), (1.0, sampled)):
            outs = greedy_batch(policy, [p.token_ids for p in chunk], max_new, EOS, temp, gen)
            res += [check(p, completion_text(o)) for p, o in zip(chunk, outs)]
    n = max(1, len(ps))
    return {"n": len(ps), "accuracy": sum(r["score"] for r in greedy) / n,
            "answer_found": sum(r["answer_found"] for r in greedy) / n,
            "lines_right": sum(r["lines_right"] for r in greedy) / n,
            "sampled_accuracy": sum(r["score"] for r in sampled) / n,
            "sampled_lines_right": sum(r["lines_right"] for r in sampled) / n,
            "solution_bytes_mean": sum(len(p.solution) for p in ps) / n,
            "operands": args.operands, "digits": args.digits}


def write_calib_texts(args):
    """Four 4095-byte texts of worked problems (prompt and solution), the
    distribution the server will see, for `fp4rollout calibrate`."""
    os.makedirs(os.path.join(args.out, "texts"), exist_ok=True)
    for i in range(4):
        text, j = "", 0
        while len(text) < 4095:
            p = problems(args.seed, f"calib{i}", 1, args.operands, args.digits, start=j)[0]
            text += p.text + p.solution + "\n"
            j += 1
        with open(os.path.join(args.out, "texts", f"calib_{i}.txt"), "w") as f:
            f.write(text[:4095])


def save_state(path, policy, opt, step):
    save_state_file({"step": step, "policy": policy.state_dict(), "opt": opt.state_dict()}, path)


def main(argv=None):
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    os.makedirs(args.out, exist_ok=True)
    state_path = os.path.join(args.out, "sft_state.pt")
    policy = load_policy(args.model).to(args.device)
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    if "dtype" in config:       # newer transformers' name of torch_dtype: the file is float32 now
        config["dtype"] = "float32"
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    start = 0
    if args.resume and os.path.exists(state_path):
        st = load_state_file(state_path, args.device)
        policy.load_state_dict(st["policy"])
        opt.load_state_dict(st["opt"])
        start = st["step"]
        print(f"sft: resumed at step {start}", flush=True)
    log_path = os.path.join(args.out, "sft_log.csv")
    keep = []
    if start > 0 and os.path.exists(log_path):     # rows past the saved state are redone
        keep = [r for r in csv.DictReader(open(log_path)) if int(r["step"]) < start]
    with open(log_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "loss", "lr", "step_s"])
        w.writeheader()
        w.writerows(keep)
    log = open(log_path, "a", newline="")
    writer = csv.DictWriter(log, fieldnames=["step", "loss", "lr", "step_s"])
    t0, slowest, step = time.monotonic(), 0.0, start
    policy.train()
    while step < args.steps:
        if args.time_limit_s > 0 and time.monotonic() - t0 + slowest > args.time_limit_s:
            print(f"sft: time limit: stopping before step {step}", flush=True)
            break
        ts = time.monotonic()
        lr = lr_at(args, step)
        for g in opt.param_groups:
            g["lr"] = lr
        opt.zero_grad(set_to_none=True)
        loss = backward_batch(policy, args, step)
        torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
        opt.step()
        dt = time.monotonic() - ts
        slowest = max(slowest, dt)
        writer.writerow({"step": step, "loss": f"{float(loss):.6g}", "lr": f"{lr:.6g}", "step_s": f"{dt:.3f}"})
        log.flush()
        if step % 10 == 0:
            print(f"sft: step {step} loss {float(loss):.4f} lr {lr:.2e} ({dt:.2f} s)", flush=True)
        step += 1
        if args.save_every > 0 and step % args.save_every == 0:
            save_state(state_path, policy, opt, step)
    log.close()
    save_state(state_path, policy, opt, step)
    save_checkpoint(policy.cpu(), config, args.out, dtype="F32")
    write_calib_texts(args)
    if step < args.steps:
        print(f"sft: stopped at step {step} of {args.steps}; run again with --resume", flush=True)
        return 3
    policy.to(args.device)
    ev = evaluate(policy, args) if args.eval_n > 0 else {}
    ev["steps"] = step
    with open(os.path.join(args.out, "sft_eval.json"), "w") as f:
        json.dump(ev, f, indent=1)
    print(f"sft: wrote {args.out}; held-out: {json.dumps(ev)}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
