"""Slow, obviously-correct loop implementations of every registered loss.

They follow SRPO.md line by line with Python loops over events, members and tokens, and exist to
be compared against the vectorised kernels in :mod:`srpo.objective.losses` (see the tests).  Do
not use them for training.
"""

from __future__ import annotations

import math

import torch


def _clip_term(ratio, adv, lo, hi):
    return -torch.minimum(ratio * adv, torch.clamp(ratio, 1 - lo, 1 + hi) * adv)


def reference_loss(name, *, logprobs, old_logprobs, mask, event_index, advantages, clip_eps=0.2,
                   clip_eps_high=None, set_reduction="sqrt", member_reduction="sum",
                   normalizer=None, ref_logprobs=None, kl_coef=0.0):
    """Same contract as :func:`srpo.objective.policy_loss`; returns the loss only."""
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    lo = clip_eps
    M, T = logprobs.shape
    members_of = {}
    for j in range(M):
        members_of.setdefault(int(event_index[j]), []).append(j)

    def tokens(j):
        return [u for u in range(T) if mask[j, u] > 0]

    def member_lr(j, reduction):
        us = tokens(j)
        s = sum((logprobs[j, u] - old_logprobs[j, u] for u in us), torch.zeros((), dtype=logprobs.dtype))
        return s / max(len(us), 1) if reduction == "mean" else s

    def member_kl(j):
        us = tokens(j)
        if ref_logprobs is None or not us:
            return torch.zeros((), dtype=logprobs.dtype)
        vals = [torch.exp(ref_logprobs[j, u] - logprobs[j, u]) - (ref_logprobs[j, u] - logprobs[j, u]) - 1 for u in us]
        return sum(vals) / len(us)

    total = torch.zeros((), dtype=logprobs.dtype)
    kl = torch.zeros((), dtype=logprobs.dtype)
    if name == "srpo":
        count = len(members_of)
        for e, js in members_of.items():
            k = len(js)
            c = {"sqrt": 1 / math.sqrt(k), "sum": 1.0, "mean": 1 / k}[set_reduction]
            L = c * sum(member_lr(j, member_reduction) for j in js)
            total = total + _clip_term(torch.exp(L), advantages[e], lo, hi)
            kl = kl + sum(member_kl(j) for j in js) / k
    elif name == "gspo":
        count = M
        for j in range(M):
            s = torch.exp(member_lr(j, "mean"))
            total = total + _clip_term(s, advantages[int(event_index[j])], lo, hi)
            kl = kl + member_kl(j)
    elif name == "grpo":
        count = 0
        for j in range(M):
            us = tokens(j)
            for u in us:
                r = torch.exp(logprobs[j, u] - old_logprobs[j, u])
                total = total + _clip_term(r, advantages[int(event_index[j])], lo, hi)
                if ref_logprobs is not None:
                    d = ref_logprobs[j, u] - logprobs[j, u]
                    kl = kl + torch.exp(d) - d - 1
            count += len(us)
    else:
        raise ValueError(name)
    n = normalizer if normalizer is not None else max(count, 1)
    return total / n + kl_coef * kl / n


def sequence_ppo_clip(*, logprobs, old_logprobs, mask, advantages, clip_eps=0.2):
    """Sequence-level PPO-clip on single responses: ratio = exp(Σ_t masked log-ratio), mean over rows."""
    lr = ((logprobs - old_logprobs) * mask).sum(1)
    return _clip_term(torch.exp(lr), advantages, clip_eps, clip_eps).mean()
