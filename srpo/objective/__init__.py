"""Pure tensor math of SRPO and its baselines.

Nothing here touches models, tokenizers, configs or files: tensors and scalars in, ``(loss,
metrics)`` out, metrics detached.  The loss reads back to the host only where it must: the
``event_index`` bounds check (one sync) and the set sizes present in the batch for the per-K
diagnostics (``torch.unique(...).tolist()``, one sync per loss call).  Other trainers
(verl, TRL, a hand-written loop) can import this sub-package alone.

Collectives: none in the losses or advantages.  The only place this sub-package talks to other
ranks is :meth:`srpo.objective.metrics.MetricAccumulator.all_reduce` (``torch.distributed``
all-reduces of the accumulated parts, when a process group is initialised) — every rank calls it
at the same point, once per step, and a caller that never calls it stays single-process.

Public API
----------
- :func:`policy_loss` — one entry point for every registered loss (``srpo``, ``grpo``, ``gspo``):
  ``policy_loss(name, LossInputs(...), LossSettings(...))``.
- :func:`group_advantages` — group-relative advantages, one per event.
- :data:`LOSSES`, :func:`register_loss`, :func:`update_unit` — the loss registry and each loss's update unit.
- :class:`~srpo.objective.metrics.Metrics` — diagnostics that declare how they combine.
- :data:`SET_REDUCTIONS`, :data:`MEMBER_REDUCTIONS` — the valid options of the set objective.
"""

from srpo.objective.advantages import ADVANTAGE_SCALES, group_advantages
from srpo.objective.losses import (
    LOSSES,
    MEMBER_REDUCTIONS,
    LossInputs,
    LossSettings,
    SET_REDUCTIONS,
    update_unit,
    policy_loss,
    register_loss,
    set_log_ratio,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "LOSSES",
    "LossInputs",
    "LossSettings",
    "MEMBER_REDUCTIONS",
    "SET_REDUCTIONS",
    "update_unit",
    "group_advantages",
    "policy_loss",
    "register_loss",
    "set_log_ratio",
]
