"""What a training step measures besides the loss: the rollout's episodes, each role's tokens, and
how far the sampler's log-probs are from the trainer's.

Every function here combines its numbers across ranks the way each metric declares
(:class:`~srpo.objective.metrics.Metrics`): those that return results run collectives, so every
rank calls them at the same point of the step.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from srpo.events import Event
from srpo.objective.metrics import MetricAccumulator, Metrics
from srpo.types import EpisodeResult


def role_lengths(events: list[Event]) -> Metrics:
    """Mean completion length per role over every event of the step (forwarded or not)."""
    lengths = Metrics()
    for role in sorted({m.role for e in events for m in e.members}):
        ms = [m for e in events for m in e.members if m.role == role]
        lengths.ratio(f"role/{role}/length", sum(m.num_action_tokens for m in ms), len(ms))
    return lengths


def role_stats(batch, lp, ent, ref) -> Metrics:
    """Per role, per action token of the forwarded events: entropy, KL to q_old (k3), and KL
    to the reference when there is one.  ``lp``, ``ent``, ``ref``: (M, T) like the batch.  A role none of whose events was forwarded reports
    nothing (nothing was measured)."""
    mask = batch.action_mask.to(lp.device)
    d = (lp - batch.old_logprobs.to(lp.device)) * mask
    kl_old = (torch.exp(d) - 1 - d) * mask
    kl_ref = None
    if ref is not None:
        delta = (ref - lp) * mask
        kl_ref = (torch.exp(delta) - delta - 1) * mask
    m = Metrics()
    roles = batch.roles
    for role in sorted(set(roles)):
        rows = torch.tensor([i for i, r in enumerate(roles) if r == role], device=lp.device)
        tokens = mask[rows].sum()
        m.ratio(f"role/{role}/entropy", (ent[rows] * mask[rows]).sum(), tokens)
        m.ratio(f"role/{role}/approx_kl", kl_old[rows].sum(), tokens)
        if kl_ref is not None:
            m.ratio(f"role/{role}/ref_kl", kl_ref[rows].sum(), tokens)
    return m



def episode_metrics(episodes: list[EpisodeResult], valid: list[Event], dropped: int, totals: dict[str, float]) -> dict[str, Any]:
    """The step's rollout, over every rank's episodes (each metric combined as it declares; a
    collective under data parallelism); ``totals`` (running counters of the run) is updated."""
    m = Metrics()
    tokens = sum(ep.generated_tokens for ep in episodes)
    correct = sum(float(ep.reward >= 1.0) for ep in episodes)
    m.mean("reward", [ep.reward for ep in episodes])  # finite for any finite rewards (a sum can overflow)
    m.ratio("accuracy", correct, len(episodes))
    m.sum("episodes", len(episodes))
    m.sum("team_tokens", tokens)
    m.sum("correct", correct)
    m.sum("events/valid", len(valid))
    m.sum("events/invalid", dropped)
    m.ratio("active_set_size/mean", sum(e.size for e in valid), len(valid))
    members = [mem for e in valid for mem in e.members]
    m.ratio("truncated_fraction", sum(mem.truncated for mem in members), len(members))
    by_type = defaultdict(list)
    for e in valid:
        by_type[e.event_type].append(e.size)
    for kind, sizes in by_type.items():
        m.ratio(f"active_set_size/{kind}", sum(sizes), len(sizes))
    info = defaultdict(float)
    for ep in episodes:
        for k, v in ep.info.items():
            if isinstance(v, (int, float)):
                info[k] += float(v)
    for k, v in info.items():
        if k == "router_set_size":  # a per-episode size: its mean over episodes
            m.ratio("router_set_size/mean", v, len(episodes))
        else:  # counters (fallbacks, tool failures, ...): summed over episodes and ranks
            m.sum(f"episodes/{k}", v)
    acc = MetricAccumulator()
    acc.add(m)
    acc.all_reduce()
    out = acc.result()
    totals["tokens"] += out["team_tokens"]
    totals["correct"] += out["correct"]
    totals["episodes"] += out["episodes"]
    out["correct_per_million_tokens"] = 1e6 * out.pop("correct") / max(out["team_tokens"], 1)
    out["cum/correct_per_million_tokens"] = 1e6 * totals["correct"] / max(totals["tokens"], 1)
    return out


class RolloutMismatch:
    """How far the sampler's log-probs (behaviour) are from the trainer's for the same tokens.

    Measured where the trainer computes q_old anyway (the recompute pass, or the update's forward
    when strictly on-policy), per role and over all action tokens: mean |Δ log p| per token, the
    fraction of tokens with |Δ| > 0.1 and the largest |Δ| (``old_vs_behaviour_max_abs``).  With
    srpo's own sampler Δ is rounding (~1e-6); with an inference engine (vLLM) it is what
    ``train.tis_cap`` corrects for.  Nothing is reported when nothing was measured."""

    THRESHOLD = 0.1

    def __init__(self):
        self.sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])  # |Δ| sum, tokens, above
        self.max_abs: float | None = None

    def add(self, batch, old: torch.Tensor) -> None:
        """``old``: (M, T) the trainer's log-probs of ``batch``'s completions."""
        mask = batch.action_mask.to(old.device) > 0
        delta = torch.where(mask, (old - batch.behaviour_logprobs.to(old.device)).abs(), torch.zeros_like(old))
        # Three (M,) reductions, read back once each, then summed per role in Python.
        rows = zip(delta.sum(1).tolist(), mask.sum(1).tolist(), (delta > self.THRESHOLD).sum(1).tolist())
        for role, row in zip(batch.roles, rows):
            s = self.sums[role]
            for k in range(3):
                s[k] += row[k]
        worst = float(delta.max()) if delta.numel() else 0.0
        self.max_abs = worst if self.max_abs is None else max(self.max_abs, worst)

    def metrics(self) -> dict[str, float]:
        """Over every rank's tokens (a collective under data parallelism: every rank calls it)."""
        m = Metrics()
        total = [0.0, 0.0, 0.0]
        for role, (abs_sum, n, above) in self.sums.items():
            m.ratio(f"role/{role}/mismatch_mean_abs", abs_sum, n)
            m.ratio(f"role/{role}/mismatch_frac_above_0.1", above, n)
            total = [a + b for a, b in zip(total, (abs_sum, n, above))]
        m.ratio("mismatch/mean_abs", total[0], total[1])
        m.ratio("mismatch/frac_above_0.1", total[2], total[1])
        if self.max_abs is not None:
            m.max("old_vs_behaviour_max_abs", torch.tensor([self.max_abs]))
        acc = MetricAccumulator()
        acc.add(m)
        acc.all_reduce()
        # Nothing is reported for what nothing was measured on (a role, or the whole step): a
        # ratio whose denominator (tokens) is 0 on every rank.
        return {k: v for k, v in acc.result().items() if acc.kinds[k] != "ratio" or acc.totals[k][1]}


def episode_record(ep: EpisodeResult) -> dict[str, Any]:
    return {"episode": ep.episode_id, "task": ep.task.task_id, "question": ep.task.question,
            "gold": list(ep.task.answers), "answer": ep.answer, "reward": ep.reward,
            "set_sizes": [e.size for e in ep.events], "transcript": ep.transcript, "info": ep.info}
