"""Pure tensor math of SRPO and its baselines.

Nothing here touches models, tokenizers, configs or files, and nothing calls ``.item()`` on the
hot path: tensors and scalars in, ``(loss, metrics)`` out, metrics detached.  Other trainers
(verl, TRL, a hand-written loop) can import this sub-package alone.

Public API
----------
- :func:`policy_loss` — one entry point for every registered loss (``srpo``, ``grpo``, ``gspo``).
- :func:`group_advantages` — group-relative advantages, one per event.
- :data:`LOSSES`, :func:`register_loss` — the loss registry.
- :data:`SET_REDUCTIONS`, :data:`MEMBER_REDUCTIONS` — the valid options of the set objective.
"""

from srpo.objective.advantages import ADVANTAGE_SCALES, group_advantages
from srpo.objective.losses import (
    LOSSES,
    MEMBER_REDUCTIONS,
    SET_REDUCTIONS,
    UPDATE_UNITS,
    policy_loss,
    register_loss,
    set_log_ratio,
)

__all__ = [
    "ADVANTAGE_SCALES",
    "LOSSES",
    "MEMBER_REDUCTIONS",
    "SET_REDUCTIONS",
    "UPDATE_UNITS",
    "group_advantages",
    "policy_loss",
    "register_loss",
    "set_log_ratio",
]
