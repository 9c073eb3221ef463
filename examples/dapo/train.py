"""DAPO on the type-completion task (task.py) or the long-reasoning
arithmetic task (arith_task.py), with rollouts from a running
`fp4rollout serve` and the policy's weights pushed back after every step.

    python3 examples/dapo/train.py --server tcp://127.0.0.1:5555 --steps 50 \\
        --batch-groups 8 --n 8 --out runs/nvfp4

writes OUT/metrics.csv (one row per step), OUT/samples.jsonl (every sample
drawn) and OUT/curves.png. The server must serve the same checkpoint as
--model, at weight version 0 (the checkpoint): step s (from 0) pushes
version s + 1. With --save-every or --time-limit-s the run saves
OUT/state.pt; --resume continues it against a fresh server (README.md,
"Checkpoint and resume").
README.md describes the algorithm and every column.
"""
import argparse
import csv
import json
import math
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "trainer_bridge", "client", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "models", "torch_qwen3"))

import torch  # noqa: E402

import arith_task  # noqa: E402
import run_state  # noqa: E402
from dapo import dapo_loss, group_advantages, informative, overlong_penalty, token_logprobs  # noqa: E402
from fp4rollout_client import RolloutClient, group_by_prompt, mismatch_metrics  # noqa: E402
from qwen3 import load_policy  # noqa: E402
from task import EOS, NEWLINE, Scorer, TypeTask, completion_text  # noqa: E402

COLUMNS = [
    "step", "rollout_version", "pushed_version", "attempts", "groups_sampled", "groups_kept", "samples_trained",
    "reward_mean", "score_mean", "batch_reward_mean", "batch_score_mean", "response_len_mean", "truncated_frac",
    "loss", "grad_norm", "lr", "clip_frac_low", "clip_frac_high", "ratio_mean", "tis_weight_mean",
    "tis_truncated_frac", "rollout_probs_diff_mean", "rollout_probs_diff_max", "rollout_probs_diff_std",
    "mismatch_kl", "divergence_kl_mean", "divergence_kl_max", "divergence_top1_agreement", "monitored_samples",
    "version_lag_mean", "current_version_share", "gen_s", "reward_s", "train_s", "push_s", "step_s",
]
# The arithmetic task's diagnostics (not rewards), after the common columns.
ARITH_COLUMNS = ["answer_found_frac", "lines_right_mean"]
# Per-task defaults of --max-tokens and --overlong-cache.
TASK_DEFAULTS = {"type": (48, 16), "arith": (1536, 256)}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", default="tcp://127.0.0.1:5555", help="the serve endpoint")
    ap.add_argument("--model", default=os.path.join(HERE, "..", "..", "..", "shared", "models", "tq6"),
                    help="checkpoint folder the server also serves (default ../shared/models/tq6)")
    ap.add_argument("--out", required=True, help="output folder (created)")
    ap.add_argument("--task", choices=["type", "arith"], default="type",
                    help="type: the Python return-type task (task.py); arith: column addition worked out "
                         "digit by digit (arith_task.py; serve the sft.py warm-up checkpoint)")
    ap.add_argument("--operands", type=int, default=8, help="arith: numbers added")
    ap.add_argument("--digits", type=int, default=20, help="arith: digits of each number")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--time-limit-s", type=float, default=0,
                    help="stop before a step that would end past this many seconds from the start, judged "
                         "by the slowest step so far (after --resume, of the last 20 before it too); the state "
                         "is saved for --resume (0: none)")
    ap.add_argument("--save-every", type=int, default=0,
                    help="save OUT/state.pt every this many steps (0: only when the run stops)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/state.pt (a fresh start when there is none); the server must "
                         "serve the checkpoint (version 0): the saved weights are pushed first")
    ap.add_argument("--batch-groups", type=int, default=8, help="informative groups per training step")
    ap.add_argument("--n", type=int, default=8, help="responses per prompt (the group size)")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="L_max: the most response tokens (default 48 for type, 1536 for arith)")
    ap.add_argument("--overlong-cache", type=int, default=None,
                    help="L_cache of the overlong penalty (0: off; default 16 for type, 256 for arith)")
    ap.add_argument("--shots", type=int, default=4, help="type: solved examples before each prompt (task.py)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--oversample", type=float, default=2.0,
                    help="prompts asked per missing group in each generation round of dynamic sampling")
    ap.add_argument("--max-attempts", type=int, default=8, help="generation rounds per step before giving up")
    ap.add_argument("--filter-on", choices=["score", "reward"], default="score",
                    help="dynamic sampling drops groups whose task scores (default) or total rewards are all equal")
    ap.add_argument("--eps-low", type=float, default=0.2)
    ap.add_argument("--eps-high", type=float, default=0.28)
    ap.add_argument("--tis-cap", type=float, default=2.0, help="C of truncated importance sampling (<= 0: off)")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup-steps", type=int, default=0, help="linear learning-rate warm-up")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--mini-batches", type=int, default=1,
                    help="optimizer updates per step, each on a share of the groups; weights are pushed "
                         "once per step, after the last")
    ap.add_argument("--micro-batch", type=int, default=0,
                    help="responses per forward pass of the trainer, gradients accumulated (0: a mini-batch "
                         "at once); bounds the trainer's memory with long responses")
    ap.add_argument("--monitor-share", type=float, default=0.25,
                    help="share of requests asked to run the BF16-KV divergence shadow (monitor=True)")
    ap.add_argument("--push-dtype", choices=["f32", "bf16"], default="f32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="torch device of the policy (cpu, cuda, cuda:1, ...)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--sandbox-jobs", type=int, default=4, help="reward processes run at once")
    ap.add_argument("--timeout-s", type=float, default=600,
                    help="deadline of one step's rollouts (its requests are aborted when it passes)")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--allow-updated-server", action="store_true",
                    help="accept a server whose weight version is not 0 (step s then pushes version base + s + 1)")
    args = ap.parse_args(argv)
    max_tokens, cache = TASK_DEFAULTS[args.task]
    args.max_tokens = max_tokens if args.max_tokens is None else args.max_tokens
    args.overlong_cache = cache if args.overlong_cache is None else args.overlong_cache
    return args


class TaskSpec:
    """What the loop needs of a task: prompts (`task.sample`, `task.rng`),
    the reward (`score(pairs)`), the stop tokens, the completion text of a
    response, and per-sample diagnostics for extra metric columns."""

    def __init__(self, args):
        if args.task == "arith":
            self.task = arith_task.ArithTask(args.seed, args.operands, args.digits)
            self.stop_ids = [arith_task.EOS]
            self.text = arith_task.completion_text
            self.columns = COLUMNS + ARITH_COLUMNS
        else:
            self.task, self.scorer = TypeTask(args.seed, args.shots), Scorer(jobs=args.sandbox_jobs)
            self.stop_ids = [NEWLINE, EOS]
            self.text = completion_text
            self.columns = COLUMNS
        self.arith = args.task == "arith"

    def score(self, pairs):
        """(scores, diagnostics) of (prompt, completion text) pairs."""
        if not self.arith:
            return self.scorer.score(pairs), [{} for _ in pairs]
        checks = [arith_task.check(p, c) for p, c in pairs]
        return [c["score"] for c in checks], checks


def generate_round(client, spec, count, args, rng, next_group):
    """Submits `count` prompts (n samples each) and returns {group_id: (prompt,
    samples)} once every sample is done."""
    prompts = {}
    for p in spec.task.sample(count):
        gid = next_group()
        client.submit(p.token_ids, n=args.n, temperature=args.temperature, top_p=args.top_p,
                      max_tokens=args.max_tokens, stop_token_ids=spec.stop_ids, seed=rng.getrandbits(53),
                      monitor=rng.random() < args.monitor_share, group_id=gid)
        prompts[gid] = p
    samples = list(client.results(timeout_ms=int(args.timeout_s * 1000)))
    groups = group_by_prompt(samples)
    missing = set(prompts) - set(groups)
    if missing:
        raise RuntimeError(f"groups {sorted(missing)[:5]} came back without samples")
    for gid, g in groups.items():
        bad = [s for s in g if s.finish_reason in ("abort", "error")]
        if bad:
            raise RuntimeError(f"group {gid}: sample {bad[0].sample} ended with {bad[0].finish_reason}")
        if len(g) != args.n:
            raise RuntimeError(f"group {gid}: {len(g)} samples, want {args.n}")
    return {gid: (prompts[gid], groups[gid]) for gid in prompts}


def weighted_mean(pairs):
    num = sum(v * w for v, w in pairs)
    den = sum(w for _, w in pairs)
    return num / den if den else float("nan")


def filter_key(args, scores, rewards):
    return scores if args.filter_on == "score" else rewards


def rollouts(client, spec, args, rng, next_group):
    """Dynamic sampling: rounds of generation until --batch-groups informative
    groups are kept or --max-attempts rounds ran. Returns (kept, dropped,
    every, attempts, gen_s, reward_s); entries are (gid, prompt, samples,
    scores, rewards, diagnostics)."""
    kept, dropped, every = [], [], []
    gen_s = reward_s = 0.0
    attempts = 0
    while len(kept) < args.batch_groups and attempts < args.max_attempts:
        attempts += 1
        need = args.batch_groups - len(kept)
        t0 = time.monotonic()
        groups = generate_round(client, spec, max(need, math.ceil(need * args.oversample)), args, rng, next_group)
        gen_s += time.monotonic() - t0
        t0 = time.monotonic()
        flat, diag = spec.score([(p, spec.text(s.token_ids)) for p, ss in groups.values() for s in ss])
        reward_s += time.monotonic() - t0
        i = 0
        for gid, (p, ss) in groups.items():
            scores, diags = flat[i:i + len(ss)], diag[i:i + len(ss)]
            i += len(ss)
            rewards = [sc + overlong_penalty(len(s.token_ids), args.max_tokens, args.overlong_cache)
                       for sc, s in zip(scores, ss)]
            entry = (gid, p, ss, scores, rewards, diags)
            every.append(entry)
            ok = informative(filter_key(args, scores, rewards))
            (kept if ok and len(kept) < args.batch_groups else dropped).append(entry)
    return kept, dropped, every, attempts, gen_s, reward_s


def old_logprobs(policy, seqs, plens, args):
    """pi_old's log-probs of every response [rows, longest], `--micro-batch`
    rows per forward."""
    policy.eval()
    step = args.micro_batch if args.micro_batch > 0 else len(seqs)
    L = max(len(s) - p for s, p in zip(seqs, plens))
    parts = []
    with torch.no_grad():
        for i in range(0, len(seqs), step):
            logp, _ = token_logprobs(policy, seqs[i:i + step], plens[i:i + step], args.temperature)
            parts.append(torch.nn.functional.pad(logp, (0, L - logp.shape[1])))
    return torch.cat(parts)


def update(policy, opt, rows, seqs, plens, old_logp, rollout_logp, adv_t, args):
    """One optimizer update on `rows`, their gradient accumulated over
    `--micro-batch` rows at a time, each micro-batch's loss weighted by its
    share of the tokens (the loss is a token mean over all rows). Returns
    (loss, gradient norm, [(stats, tokens)])."""
    step = args.micro_batch if args.micro_batch > 0 else len(rows)
    tokens = float(sum(len(seqs[r]) - plens[r] for r in rows))
    opt.zero_grad(set_to_none=True)
    total, stats = 0.0, []
    for i in range(0, len(rows), step):
        part = rows[i:i + step]
        idx = torch.tensor(part)
        logp, m = token_logprobs(policy, [seqs[r] for r in part], [plens[r] for r in part], args.temperature)
        Lc = m.shape[1]
        loss, st = dapo_loss(logp, old_logp[idx, :Lc], rollout_logp[idx, :Lc], adv_t[idx], m,
                             args.eps_low, args.eps_high, args.tis_cap)
        share = float(m.sum()) / tokens
        (loss * share).backward()
        total += float(loss) * share
        stats.append((st, float(m.sum())))
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.grad_clip)
    opt.step()
    return total, float(norm), stats


def train_on(policy, opt, batch, args):
    """pi_old log-probs, mismatch figures and the optimizer updates of one
    step. Returns (seqs, versions, mismatch, losses, norms, stats_acc)."""
    seqs, plens, roll, advs, versions = [], [], [], [], []
    for gid, p, ss, scores, rewards, _ in batch:
        a = group_advantages(rewards) if informative(filter_key(args, scores, rewards)) else [0.0] * len(ss)
        for s, adv in zip(ss, a):
            seqs.append(p.token_ids + s.token_ids)
            plens.append(len(p.token_ids))
            roll.append(s.logprobs)
            advs.append(adv)
            versions.extend(s.weight_versions)
    L = max(len(r) for r in roll)
    rollout_logp = torch.tensor([r + [0.0] * (L - len(r)) for r in roll], dtype=torch.float32)
    adv_t = torch.tensor(advs, dtype=torch.float32)
    old_logp = old_logprobs(policy, seqs, plens, args)
    mm = mismatch_metrics(roll, [old_logp[b, :len(r)].tolist() for b, r in enumerate(roll)])

    policy.train()
    order = list(range(len(batch)))
    chunks = [order[i::args.mini_batches] for i in range(args.mini_batches)]
    starts, pos = [], 0
    for e in batch:
        starts.append(pos)
        pos += len(e[2])
    losses, norms, stats_acc = [], [], []
    for chunk in chunks:
        if not chunk:
            continue
        rows = [starts[g] + j for g in chunk for j in range(len(batch[g][2]))]
        loss, norm, st = update(policy, opt, rows, seqs, plens, old_logp, rollout_logp, adv_t, args)
        losses.append(loss)
        norms.append(norm)
        stats_acc.extend(st)
    return seqs, versions, mm, losses, norms, stats_acc


def push(client, policy, version, args):
    dt = torch.bfloat16 if args.push_dtype == "bf16" else torch.float32
    named = {n: p.detach().to("cpu", dt).contiguous() for n, p in policy.named_parameters()}
    reply = client.update_weights(named, version=version)
    if reply["weight_version"] != version:
        raise RuntimeError(f"update_weights answered {reply}, want version {version}")


def metrics_row(step, version, sampled, trained, timing):
    """One metrics.csv row: sampled = (kept, batch, every, attempts), trained
    = train_on's result, timing = (gen_s, reward_s, train_s, push_s, t_step)."""
    kept, batch, every, attempts = sampled
    seqs, versions, mm, losses, norms, stats_acc = trained
    gen_s, reward_s, train_s, push_s, t_step = timing
    all_samples = [(s, sc, rw) for _, _, ss, scs, rws, _ in every for s, sc, rw in zip(ss, scs, rws)]
    n = len(all_samples)
    mon = [s.divergence for s, _, _ in all_samples if s.divergence.get("kl_mean") is not None
           and s.divergence.get("positions")]
    lag = [version - v for v in versions]
    tok_stats = lambda key: weighted_mean([(st[key], w) for st, w in stats_acc])  # noqa: E731
    row = {
        "step": step, "rollout_version": version, "pushed_version": version + 1, "attempts": attempts,
        "groups_sampled": len(every), "groups_kept": len(kept), "samples_trained": len(seqs),
        "reward_mean": sum(rw for _, _, rw in all_samples) / n, "score_mean": sum(sc for _, sc, _ in all_samples) / n,
        "batch_reward_mean": sum(sum(e[4]) for e in batch) / len(seqs),
        "batch_score_mean": sum(sum(e[3]) for e in batch) / len(seqs),
        "response_len_mean": sum(len(s.token_ids) for s, _, _ in all_samples) / n,
        "truncated_frac": sum(s.finish_reason == "length" for s, _, _ in all_samples) / n,
        "loss": sum(losses) / len(losses), "grad_norm": sum(norms) / len(norms),
        "clip_frac_low": tok_stats("clip_frac_low"), "clip_frac_high": tok_stats("clip_frac_high"),
        "ratio_mean": tok_stats("ratio_mean"), "tis_weight_mean": tok_stats("tis_weight_mean"),
        "tis_truncated_frac": tok_stats("tis_truncated_frac"),
        "rollout_probs_diff_mean": mm["rollout_probs_diff_mean"],
        "rollout_probs_diff_max": mm["rollout_probs_diff_max"],
        "rollout_probs_diff_std": mm["rollout_probs_diff_std"], "mismatch_kl": mm["mismatch_kl"],
        "divergence_kl_mean": weighted_mean([(d["kl_mean"], d["positions"]) for d in mon]),
        "divergence_kl_max": max((d["kl_max"] for d in mon), default=float("nan")),
        "divergence_top1_agreement": weighted_mean([(d["top1_agreement"], d["positions"]) for d in mon]),
        "monitored_samples": len(mon),
        "version_lag_mean": sum(lag) / len(lag) if lag else float("nan"),
        "current_version_share": sum(x == 0 for x in lag) / len(lag) if lag else float("nan"),
        "gen_s": gen_s, "reward_s": reward_s, "train_s": train_s, "push_s": push_s,
        "step_s": time.monotonic() - t_step,
    }
    diags = [d for e in every for d in e[5] if d]
    if diags:
        row["answer_found_frac"] = sum(d["answer_found"] for d in diags) / len(diags)
        row["lines_right_mean"] = sum(d["lines_right"] for d in diags) / len(diags)
    return row


def write_samples(samples_f, spec, step, every, batch, args):
    in_batch = {e[0] for e in batch}
    for gid, p, ss, scs, rws, diags in every:
        advs_g = group_advantages(rws) if gid in in_batch and informative(filter_key(args, scs, rws)) else None
        for j, (s, sc, rw) in enumerate(zip(ss, scs, rws)):
            line = {
                "step": step, "group_id": gid, "sample": s.sample, "prompt": p.text,
                "completion": spec.text(s.token_ids), "score": sc, "reward": rw,
                "advantage": advs_g[j] if advs_g else None, "trained": gid in in_batch,
                "finish_reason": s.finish_reason, "n_tokens": len(s.token_ids),
                "weight_versions": sorted(set(s.weight_versions)), "kl_mean": s.divergence.get("kl_mean")}
            if diags[j]:
                line["lines_right"] = diags[j]["lines_right"]
            samples_f.write(json.dumps(line) + "\n")
    samples_f.flush()


def connect(args, policy):
    """The client and the server's weight version (checked as train.py wants it)."""
    client = RolloutClient(args.server, timeout_ms=int(args.timeout_s * 1000))
    info = client.hello("dapo-train")
    if info["vocab_size"] != policy.config.vocab_size:
        sys.exit(f"train: the server's vocabulary has {info['vocab_size']} tokens, the policy's "
                 f"{policy.config.vocab_size}: not the same model")
    if args.n > info["max_seqs"]:
        sys.exit(f"train: --n {args.n} exceeds the server's max_seqs {info['max_seqs']}")
    base = int(info["weight_version"])
    if base != 0 and not args.allow_updated_server:
        sys.exit(f"train: the server serves weight version {base}, not the checkpoint (version 0); restart it, "
                 f"or pass --allow-updated-server if it serves the same weights as --model")
    print(f"train: server {args.server}: {info['model']} ({info['backend']}, kv {info['kv_dtype']}), "
          f"weight version {base}", flush=True)
    return client, info, base


def open_outputs(args, spec, info, start):
    """metrics.csv (its writer) and samples.jsonl, fresh or continued at `start`."""
    mpath = os.path.join(args.out, "metrics.csv")
    if start > 0:
        rows, lines = run_state.trim_outputs(args.out, start)
        if rows != start:
            sys.exit(f"train: {mpath} holds {rows} rows before step {start}; it does not belong to this state")
        print(f"train: resuming at step {start} ({rows} metric rows, {lines} samples kept)", flush=True)
        with open(os.path.join(args.out, "resumes.jsonl"), "a") as f:
            f.write(json.dumps({"step": start, "time": time.time(), "args": vars(args)}) + "\n")
    metrics_f = open(mpath, "a" if start > 0 else "w", newline="")
    writer = csv.DictWriter(metrics_f, fieldnames=spec.columns)
    if start == 0:
        writer.writeheader()
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump({**vars(args), "server_info": info}, f, indent=1)
    samples_f = open(os.path.join(args.out, "samples.jsonl"), "a" if start > 0 else "w")
    return metrics_f, writer, samples_f


def resume_policy(args, policy, opt, rng, spec):
    """(start step, version base, group counter) from OUT/state.pt, else from
    OUT/handoff (the BF16 policy, a fresh optimizer), or a fresh start's."""
    state = run_state.load_state(args.out, args.device) if args.resume else None
    handoff = run_state.load_handoff(args.out) if args.resume and state is None else None
    if state is None and handoff is None:
        return 0, None, 0
    changed = run_state.changed_options((state or handoff)["args"], args)
    if changed:
        sys.exit(f"train: --resume with options that differ from the saved run's: {', '.join(changed)}")
    if state is not None:
        run_state.restore(state, policy, opt, rng, spec.task.rng)
        return state["step"], state["base"], state["group_counter"]
    run_state.restore_handoff(args.out, handoff, policy, rng, spec.task.rng)
    print(f"train: no {run_state.STATE}; going on from {args.out}/{run_state.HANDOFF} at step {handoff['step']} "
          f"with its BF16 policy and a fresh optimizer", flush=True)
    return handoff["step"], handoff["base"], handoff["group_counter"]


def save_run(args, config, step, base, policy, opt, rng, spec, group_counter):
    """OUT/state.pt and OUT/handoff (run_state.py)."""
    run_state.save_state(args.out, step, base, policy, opt, rng, spec.task.rng, group_counter, args)
    run_state.save_handoff(args.out, step, base, policy, config, rng, spec.task.rng, group_counter, args)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.monotonic()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    os.makedirs(args.out, exist_ok=True)
    policy = load_policy(args.model).to(args.device)
    with open(os.path.join(args.model, "config.json")) as f:
        config = json.load(f)
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay)
    spec = TaskSpec(args)
    start, saved_base, groups_made = resume_policy(args, policy, opt, rng, spec)
    client, info, base = connect(args, policy)
    if start > 0:
        # The server serves the checkpoint: the saved weights go first, under
        # the version they had, so the rollout versions go on where they were.
        base = saved_base
        push(client, policy, base + start, args)
        print(f"train: pushed the saved weights as version {base + start}", flush=True)
    group_counter = [groups_made]

    def next_group():
        group_counter[0] += 1
        return group_counter[0]

    metrics_f, writer, samples_f = open_outputs(args, spec, info, start)
    # A resumed run judges its first step by the slowest of the last steps
    # before it, so that a call does not begin a step it cannot finish.
    slowest, step = (run_state.recent_slowest_step(args.out) if start > 0 else 0.0), start
    while step < args.steps:
        if args.time_limit_s > 0 and time.monotonic() - t_start + slowest > args.time_limit_s:
            print(f"train: time limit of {args.time_limit_s:g} s: stopping before step {step}", flush=True)
            break
        t_step = time.monotonic()
        version = base + step                 # the weights serving now
        lr = args.lr * min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps > 0 else args.lr
        for g in opt.param_groups:
            g["lr"] = lr
        kept, dropped, every, attempts, gen_s, reward_s = rollouts(client, spec, args, rng, next_group)
        # With no informative group at all, the step trains on uninformative ones:
        # their advantages are 0, so the policy gradient is 0.
        batch = kept if kept else dropped[:args.batch_groups]
        t0 = time.monotonic()
        trained = train_on(policy, opt, batch, args)
        train_s = time.monotonic() - t0
        t0 = time.monotonic()
        push(client, policy, version + 1, args)
        push_s = time.monotonic() - t0
        row = metrics_row(step, version, (kept, batch, every, attempts), trained,
                          (gen_s, reward_s, train_s, push_s, t_step))
        row["lr"] = lr
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in row.items()})
        metrics_f.flush()
        write_samples(samples_f, spec, step, every, batch, args)
        print(f"step {step}: score {row['score_mean']:.3f} reward {row['reward_mean']:.3f} "
              f"len {row['response_len_mean']:.1f} kept {len(kept)}/{len(every)} groups in {attempts} rounds, "
              f"loss {row['loss']:.4f}, mismatch_kl {row['mismatch_kl']:.2e}, "
              f"div kl {row['divergence_kl_mean']:.2e}, pushed v{version + 1} "
              f"({gen_s:.1f}s gen, {train_s:.1f}s train, {push_s:.1f}s push)", flush=True)
        step += 1
        slowest = max(slowest, time.monotonic() - t_step)
        if args.save_every > 0 and step % args.save_every == 0 and step < args.steps:
            save_run(args, config, step, base, policy, opt, rng, spec, group_counter[0])

    metrics_f.close()
    samples_f.close()
    client.close()
    if args.save_every > 0 or args.time_limit_s > 0 or args.resume:
        save_run(args, config, step, base, policy, opt, rng, spec, group_counter[0])
    if not args.no_plot:
        from plot import plot_run
        plot_run(os.path.join(args.out, "metrics.csv"), os.path.join(args.out, "curves.png"))
    print(f"train: wrote {args.out}/metrics.csv" + ("" if args.no_plot else " and curves.png")
          + (f"; stopped at step {step} of {args.steps} (--resume continues)" if step < args.steps else ""))


if __name__ == "__main__":
    main()
