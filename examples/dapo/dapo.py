"""The pieces of DAPO (Yu et al., 2025) the trainer uses, as plain functions;
README.md gives the formulas."""
import math

import torch


def overlong_penalty(length, max_len, cache_len):
    """Soft overlong punishment: 0 up to max_len - cache_len tokens, then falling
    linearly to -1 at max_len, and -1 beyond."""
    if cache_len <= 0:
        return 0.0 if length <= max_len else -1.0
    start = max_len - cache_len
    if length <= start:
        return 0.0
    if length <= max_len:
        return (start - length) / cache_len
    return -1.0


def group_advantages(rewards, eps=1e-6):
    """(R_i - mean R) / (std R + eps) over one group (population std)."""
    n = len(rewards)
    mean = sum(rewards) / n
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / n)
    return [(r - mean) / (std + eps) for r in rewards]


def informative(values):
    """Dynamic sampling keeps a group only when its values are not all equal."""
    return max(values) != min(values)


def token_logprobs(policy, sequences, prompt_lens, temperature=1.0):
    """Per-token log-probs of the responses under the policy.

    sequences: list of token-id lists (prompt + response); prompt_lens: the
    prompt part of each. Returns (logp [B, L], mask [B, L]) with L the longest
    response: logp[b, j] = log softmax(logits / temperature) of response token j
    of sequence b, mask 1 on real tokens. Rows are right-padded, so padding
    never reaches a real token through the causal attention.
    """
    dev = next(policy.parameters()).device
    B = len(sequences)
    T = max(len(s) for s in sequences)
    L = max(len(s) - p for s, p in zip(sequences, prompt_lens))
    ids = torch.zeros((B, T), dtype=torch.long)
    for b, s in enumerate(sequences):
        ids[b, :len(s)] = torch.tensor(s, dtype=torch.long)
    logits = policy(ids.to(dev))
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits.float(), dim=-1)
    # the logits at position t predict token t + 1
    pos = torch.zeros((B, L), dtype=torch.long)
    tgt = torch.zeros((B, L), dtype=torch.long)
    mask = torch.zeros((B, L))
    for b, (s, p) in enumerate(zip(sequences, prompt_lens)):
        n = len(s) - p
        pos[b, :n] = torch.arange(p - 1, p - 1 + n)
        tgt[b, :n] = torch.tensor(s[p:], dtype=torch.long)
        mask[b, :n] = 1.0
    logp = logp_all[torch.arange(B, device=dev)[:, None], pos.to(dev), tgt.to(dev)].cpu()
    return logp * mask, mask


def dapo_loss(logp, old_logp, rollout_logp, adv, mask, eps_low=0.2, eps_high=0.28, tis_cap=2.0):
    """The DAPO token-level clipped objective with truncated importance sampling.

    logp: the policy's log-probs (with grad), old_logp: the same policy's before
    the update (pi_old, no grad), rollout_logp: the rollout engine's, adv: one
    advantage per sequence [B], mask [B, L]. Returns (loss, stats): loss is
    -sum over tokens of w * min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)
    divided by the number of tokens, with r = exp(logp - old_logp) and
    w = min(exp(old_logp - rollout_logp), tis_cap) (tis_cap <= 0: w = 1).
    """
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None]
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    surrogate = torch.minimum(ratio * a, clipped * a)
    if tis_cap > 0:
        raw_w = torch.exp(old_logp - rollout_logp)
        w = torch.clamp(raw_w, max=tis_cap).detach()
    else:
        raw_w = torch.ones_like(ratio)
        w = raw_w
    tokens = mask.sum().clamp(min=1.0)
    loss = -(w * surrogate * mask).sum() / tokens
    with torch.no_grad():
        clip_low = ((ratio < 1.0 - eps_low) & (a < 0)).float()
        clip_high = ((ratio > 1.0 + eps_high) & (a > 0)).float()
        stats = {
            "clip_frac_low": float((clip_low * mask).sum() / tokens),
            "clip_frac_high": float((clip_high * mask).sum() / tokens),
            "tis_truncated_frac": float(((raw_w > tis_cap).float() * mask).sum() / tokens) if tis_cap > 0 else 0.0,
            "tis_weight_mean": float((w * mask).sum() / tokens),
            "ratio_mean": float((ratio * mask).sum() / tokens),
        }
    return loss, stats
