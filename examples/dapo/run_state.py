"""What a DAPO run saves to be resumed, and how its append-only outputs are
brought back to the saved step.

OUT/state.pt holds the policy, the optimizer, every random state that draws
prompts, seeds and monitor choices (Python's for the trainer and the task,
torch's), the group counter, the next step and the weight version base. It
is written after the step's rows are flushed, through a temporary file and
a rename, so a run killed at any moment leaves either the previous state or
the new one. Rows written after the state (a run killed between a save and
the next) belong to steps the resumed run does again: `trim_outputs` drops
them so that metrics.csv and samples.jsonl hold each step once.

OUT/handoff/ is written beside it: the policy as a checkpoint folder in BF16
(which a server can start from) and trainer.pt, the state without the
optimizer. It is what a run spread over machines carries when state.pt (the
float32 policy and AdamW's two moments, six times larger) cannot travel:
--resume without state.pt goes on from it with a fresh optimizer, on the same
prompts, seeds and monitor choices, no longer bitwise the uninterrupted run.
"""
import csv
import json
import os

import torch

from qwen3 import load_policy, load_state_file, save_checkpoint, save_state_file   # models/torch_qwen3

STATE = "state.pt"
HANDOFF = "handoff"

# Options a resumed run may change; every other one must match the saved run,
# or the resumed steps would not continue the same experiment. (out: the
# folder the state is read from, wherever the run was moved.)
MAY_CHANGE = {"steps", "time_limit_s", "server", "resume", "threads", "no_plot", "timeout_s", "save_every",
              "sandbox_jobs", "device", "model", "allow_updated_server",
              "micro_batch", "out"}


def save_state(out, step, base, policy, opt, rng, task_rng, group_counter, args):
    state = {
        "step": step, "base": base, "policy": policy.state_dict(), "opt": opt.state_dict(),
        "rng": rng.getstate(), "task_rng": task_rng.getstate(), "torch_rng": torch.get_rng_state(),
        "group_counter": group_counter, "args": vars(args),
    }
    save_state_file(state, os.path.join(out, STATE))


def save_handoff(out, step, base, policy, config, rng, task_rng, group_counter, args):
    """OUT/handoff: the policy in BF16 under config (the checkpoint's config.json)
    and trainer.pt, everything of save_state but the optimizer."""
    folder = os.path.join(out, HANDOFF)
    save_checkpoint(policy, config, folder, dtype="BF16")
    state = {
        "step": step, "base": base, "rng": rng.getstate(), "task_rng": task_rng.getstate(),
        "torch_rng": torch.get_rng_state(), "group_counter": group_counter, "args": vars(args),
    }
    save_state_file(state, os.path.join(folder, "trainer.pt"))


def load_handoff(out):
    """OUT/handoff's trainer state, or None when OUT holds none."""
    path = os.path.join(out, HANDOFF, "trainer.pt")
    return load_state_file(path, "cpu") if os.path.exists(path) else None


def restore_handoff(out, state, policy, rng, task_rng):
    """The handoff's BF16 policy (as float32) and random states."""
    src = load_policy(os.path.join(out, HANDOFF))
    with torch.no_grad():
        for p, q in zip(policy.parameters(), src.parameters()):
            p.copy_(q.to(p.device))
    rng.setstate(state["rng"])
    task_rng.setstate(state["task_rng"])
    torch.set_rng_state(state["torch_rng"].cpu())


def load_state(out, device):
    """The saved state, or None when OUT holds none."""
    path = os.path.join(out, STATE)
    return load_state_file(path, device) if os.path.exists(path) else None


def changed_options(saved, args):
    """Names of options that differ from the saved run's and may not."""
    now = vars(args)
    return sorted(k for k in now if k not in MAY_CHANGE and k in saved and saved[k] != now[k])


def restore(state, policy, opt, rng, task_rng):
    policy.load_state_dict(state["policy"])
    opt.load_state_dict(state["opt"])
    rng.setstate(state["rng"])
    task_rng.setstate(state["task_rng"])
    torch.set_rng_state(state["torch_rng"].cpu())     # loaded onto the policy's device


def trim_outputs(out, step):
    """Keeps the rows of metrics.csv and the lines of samples.jsonl of steps
    before `step`; returns (metric rows kept, sample lines kept)."""
    mpath, spath = os.path.join(out, "metrics.csv"), os.path.join(out, "samples.jsonl")
    rows, fields = [], None
    if os.path.exists(mpath):
        with open(mpath, newline="") as f:
            r = csv.DictReader(f)
            fields = r.fieldnames
            rows = [row for row in r if int(row["step"]) < step]
        with open(mpath + ".tmp", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(rows)
        os.replace(mpath + ".tmp", mpath)
    lines = []
    if os.path.exists(spath):
        with open(spath) as f:
            lines = [ln for ln in f if ln.strip() and json.loads(ln)["step"] < step]
        with open(spath + ".tmp", "w") as f:
            f.writelines(lines)
        os.replace(spath + ".tmp", spath)
    return len(rows), len(lines)


def recent_slowest_step(out, last=20):
    """The longest `step_s` of the last `last` rows of metrics.csv (0 when none)."""
    path = os.path.join(out, "metrics.csv")
    if not os.path.exists(path):
        return 0.0
    with open(path, newline="") as f:
        times = [float(r["step_s"]) for r in csv.DictReader(f)]
    return max(times[-last:], default=0.0)
