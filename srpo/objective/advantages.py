"""Group-relative advantages: one scalar per event, measured against its group.

    Â_e = (R_e − mean_{g(e)}) / (std_{g(e)} + eps)        (SRPO.md, step 4)

``std`` is the sample standard deviation (Bessel-corrected, ``unbiased=True``), as verl's
``compute_grpo_outcome_advantage`` and TRL's ``GRPOTrainer`` compute it.  A group with a single
event has no peer to be compared with, so its advantage is 0 (not NaN).

Which events form a group is the caller's choice of ``group_ids``; :mod:`srpo.methods` defines
them per method: (task, event type, turn) for SRPO, GRPO and GSPO; (task, role) for Dr. MAS-style
agent-wise normalisation and (task, role, turn) for AT-GRPO, both after splitting each K-event
into its members.
"""

from __future__ import annotations

import math
import typing

import torch

from srpo.config import AdvantageScale

ADVANTAGE_SCALES: tuple[str, ...] = typing.get_args(AdvantageScale)  # ("std", "none"), from the schema


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: str = "std",
    eps: float = 1e-6,
) -> torch.Tensor:
    """Group-normalised advantages.

    Args:
        rewards: (E,) float, the return seen from each event.
        group_ids: (E,) integer, any values; events with equal ids form one group.
        scale: ``"std"`` divides by ``std_g + eps``; ``"none"`` only subtracts the group mean
            (Dr. GRPO style).
        eps: added to the standard deviation.

    Returns:
        (E,) float advantages, same dtype as ``rewards`` (float32 at least); a group of one gets 0.
    """
    if scale not in ADVANTAGE_SCALES:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: {', '.join(ADVANTAGE_SCALES)}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must both be (E,); got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    dtype = torch.promote_types(rewards.dtype, torch.float32)
    rewards = rewards.to(dtype)
    if rewards.numel() == 0:
        return rewards.clone()
    # Finite rewards near the dtype's limit (±1e308 in float64) overflow the group sums and squares
    # to inf/NaN.  Scaled by a power of two (exact) so the largest is 1, the statistics stay
    # finite; a std-scaled advantage does not depend on the scale, a centred one is scaled back.
    big = float(rewards.abs().max()) if torch.isfinite(rewards).all() else 0.0
    if big > 2.0 ** 60:
        shift = 2.0 ** -math.ceil(math.log2(big))
        scaled = group_advantages(rewards * shift, group_ids, scale=scale, eps=eps * shift)
        return scaled if scale == "std" else scaled / shift
    _, inverse = torch.unique(group_ids, return_inverse=True)  # (E,) in [0, G)
    num_groups = int(inverse.max()) + 1
    count = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(
        0, inverse, torch.ones_like(rewards)
    )  # (G,)
    total = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, inverse, rewards)
    mean = total / count  # (G,)
    centred = rewards - mean[inverse]  # (E,)
    if scale == "none":
        return torch.where(count[inverse] > 1, centred, torch.zeros_like(centred))
    sq = torch.zeros(num_groups, dtype=dtype, device=rewards.device).index_add_(0, inverse, centred**2)
    std = torch.sqrt(sq / (count - 1).clamp(min=1))  # (G,) Bessel-corrected
    denom = std[inverse] + eps
    # A group of one, or (with eps=0) a group of equal rewards, carries no signal: 0, not NaN.
    usable = (count[inverse] > 1) & (denom > 0)
    return torch.where(usable, centred / torch.where(usable, denom, torch.ones_like(denom)), torch.zeros_like(centred))
