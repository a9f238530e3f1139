"""SRPO inside verl: a set-level policy loss and an event-grouped advantage estimator.

    import srpo.integrations.verl as srpo_verl
    srpo_verl.register(set_reduction="sqrt")    # once, in the driver and in every actor worker

then, in the verl config::

    algorithm.adv_estimator=srpo_event
    actor_rollout_ref.actor.policy_loss.loss_mode=srpo

Mapping of our event fields onto verl's batch:

- verl's ``uid`` (``index`` in advantage estimators) is the advantage *group*: give every response
  of one (task, event type, turn) the same uid, as SRPO groups events (SRPO.md step 4).
- One event = the responses it consumed.  verl's policy-loss functions receive only tensors, so
  the event of each row travels beside the micro-batch: put a long tensor
  ``srpo_event_index`` (event id per row, rows of one event in the same micro-batch) in
  ``data.batch`` and wrap the actor's loss call in ``with event_context(event_index, num_events):``
  (``num_events``: the events in the whole optimizer step across ranks, SRPO's |B|).  Without a
  context every row is its own event (K = 1): SRPO then reduces to sequence-level PPO-clip
  (``member_reduction="sum"``) or to GSPO (``"mean"``).
- The advantage verl broadcasts over a response's tokens is read back once per event.

Only :mod:`verl.trainer.ppo.core_algos` is touched; importing this module does not import verl
until :func:`register` runs.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import torch

from srpo.objective import LossInputs, LossSettings, group_advantages, policy_loss

_EVENTS: contextvars.ContextVar[tuple[torch.Tensor, int | None] | None] = contextvars.ContextVar("srpo_events",
                                                                                                default=None)
_OPTIONS: dict[str, Any] = {"set_reduction": "sqrt", "member_reduction": "sum"}


@contextlib.contextmanager
def event_context(event_index: torch.Tensor, num_events: int | None = None):
    """Make the rows' events (and the global event count) visible to the ``srpo`` loss."""
    token = _EVENTS.set((event_index, num_events))
    try:
        yield
    finally:
        _EVENTS.reset(token)


def _per_row(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(bs, T) value broadcast over each response's tokens → (bs,)."""
    return (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)


def srpo_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                     config=None, rollout_is_weights=None):
    """verl ``PolicyLossFn`` computing SRPO's set objective (``loss_agg_mode`` is not used: SRPO
    always averages over events)."""
    bs = log_prob.shape[0]
    ctx = _EVENTS.get()
    if ctx is None:
        event_index, num_events = torch.arange(bs, device=log_prob.device), None
    else:
        event_index, num_events = ctx[0].to(log_prob.device), ctx[1]
    _, event_index = torch.unique(event_index, return_inverse=True)  # (bs,) in [0, E)
    E = int(event_index.max()) + 1 if bs else 0
    row_adv = _per_row(advantages, response_mask.to(advantages.dtype))
    event_adv = torch.zeros(E, dtype=row_adv.dtype, device=row_adv.device).index_reduce_(
        0, event_index, row_adv, "mean", include_self=False)
    clip = getattr(config, "clip_ratio", 0.2) if config is not None else 0.2
    low = getattr(config, "clip_ratio_low", None) if config is not None else None
    high = getattr(config, "clip_ratio_high", None) if config is not None else None
    loss, metrics = policy_loss("srpo", LossInputs(
        logprobs=log_prob, old_logprobs=old_log_prob, mask=response_mask, event_index=event_index,
        advantages=event_adv, normalizer=num_events),
        LossSettings(clip_eps=low if low is not None else clip, clip_eps_high=high if high is not None else clip,
        set_reduction=_OPTIONS["set_reduction"], member_reduction=_OPTIONS["member_reduction"]))
    if num_events is not None and config is not None:
        # verl's FSDP backends average gradients over data-parallel ranks; undo it so the
        # global-event normaliser holds (the same dp_size scaling verl's agg_loss applies).
        loss = loss * getattr(config, "global_batch_info", {}).get("dp_size", 1)
    return loss, {f"actor/srpo/{k}": float(v) for k, v in metrics.items() if v.dim() == 0}


def srpo_event_advantage(token_level_rewards, response_mask, index, epsilon: float = 1e-6,
                         norm_adv_by_std_in_grpo: bool = True, config=None, **_):
    """verl advantage estimator: group-relative advantages over verl's ``index`` groups (give the
    responses of one (task, event type, turn) one uid).  Returns (advantages, returns), (bs, T)."""
    scores = token_level_rewards.sum(-1)
    _, group_ids = __import__("numpy").unique(index, return_inverse=True)
    adv = group_advantages(scores, torch.as_tensor(group_ids, device=scores.device),
                           scale="std" if norm_adv_by_std_in_grpo else "none", eps=epsilon).to(scores.dtype)
    adv = adv.unsqueeze(-1) * response_mask
    return adv, adv


def register(*, set_reduction: str = "sqrt", member_reduction: str = "sum") -> None:
    """Register ``srpo`` (policy loss) and ``srpo_event`` (advantage estimator) with verl."""
    from verl.trainer.ppo import core_algos

    _OPTIONS.update(set_reduction=set_reduction, member_reduction=member_reduction)
    if "srpo" not in core_algos.POLICY_LOSS_REGISTRY:
        core_algos.register_policy_loss("srpo")(srpo_policy_loss)
    if "srpo_event" not in core_algos.ADV_ESTIMATOR_REGISTRY:
        core_algos.register_adv_est("srpo_event")(srpo_event_advantage)
