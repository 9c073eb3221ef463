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
"""
import csv
import json
import os

import torch

from qwen3 import load_state_file, save_state_file   # models/torch_qwen3, on the path of train.py

STATE = "state.pt"

# Options a resumed run may change; every other one must match the saved run,
# or the resumed steps would not continue the same experiment.
MAY_CHANGE = {"steps", "time_limit_s", "server", "resume", "threads", "no_plot", "timeout_s", "save_every",
              "sandbox_jobs", "device", "model", "allow_updated_server",
              "micro_batch"}


def save_state(out, step, base, policy, opt, rng, task_rng, group_counter, args):
    state = {
        "step": step, "base": base, "policy": policy.state_dict(), "opt": opt.state_dict(),
        "rng": rng.getstate(), "task_rng": task_rng.getstate(), "torch_rng": torch.get_rng_state(),
        "group_counter": group_counter, "args": vars(args),
    }
    save_state_file(state, os.path.join(out, STATE))


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
