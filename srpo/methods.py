"""Methods: which loss, and which events are compared when computing advantages.

| method  | loss | advantage groups                   | unit of the advantage           |
|---------|------|------------------------------------|---------------------------------|
| srpo    | srpo | (task, event type, turn)           | the event (its whole set)       |
| grpo    | grpo | (task, event type, turn)           | the event, shared by its members|
| gspo    | gspo | (task, event type, turn)           | the event, shared by its members|
| dr_mas  | grpo | (task, role)  — agent-wise         | each member                     |
| at_grpo | grpo | (task, role, turn)                 | each member                     |

For the member-level methods, an event of K members is split into K single-member events before
advantages are computed (their losses treat members independently, so only the advantages change).

:class:`UpdateSettings` is how the update runs a method: passes, mini-batches, the loss's
hyperparameters — fixed for a run, built once by :func:`srpo.build.update_settings`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo.events import Event
from srpo.objective import LOSSES, LossSettings, group_advantages
from srpo.registry import Registry


GROUP_FIELDS = ("task", "event_type", "turn", "role")


@dataclass(frozen=True)
class Method:
    """A method: the registered ``loss`` it optimises, the fields of :data:`GROUP_FIELDS` whose
    equal values put events in one advantage group, and whether K-events are split into one-member
    events first (member-level baselines)."""

    loss: str
    group_by: tuple[str, ...]
    per_member: bool = False

    def __post_init__(self):
        bad = [f for f in self.group_by if f not in GROUP_FIELDS]
        if bad:
            raise ValueError(f"group_by field {bad[0]!r} is not valid; valid: {', '.join(GROUP_FIELDS)}")


def _is_method(obj) -> None:
    if not isinstance(obj, Method):
        raise TypeError("expected an srpo.methods.Method(loss, group_by, per_member)")
    if obj.loss not in LOSSES:
        raise TypeError(f"unknown loss {obj.loss!r}; valid: {', '.join(LOSSES.names())}")


#: name → :class:`Method`: ``register_method(name, Method(...))``, or name one by import path.
METHODS: Registry[Method] = Registry("method", accepts=_is_method)
register_method = METHODS.register


register_method("srpo", Method("srpo", ("task", "event_type", "turn")))
register_method("grpo", Method("grpo", ("task", "event_type", "turn")))
register_method("gspo", Method("gspo", ("task", "event_type", "turn")))
register_method("dr_mas", Method("grpo", ("task", "role"), per_member=True))
register_method("at_grpo", Method("grpo", ("task", "role", "turn"), per_member=True))


def split_members(events: list[Event]) -> list[Event]:
    """One single-member event per member (same reward, type and turn)."""
    out = []
    for e in events:
        for j, m in enumerate(e.members):
            out.append(Event(f"{e.event_id}/{j}", e.episode_id, e.task_id, f"{e.prior_state_id}/{j}", e.event_type,
                             e.turn, 1, [m], e.reward, e.advantage, transition_size=e.set_size))
    return out


def _key(event: Event, fields: tuple[str, ...]) -> tuple:
    values = {"task": event.task_id, "event_type": event.event_type, "turn": event.turn,
              "role": event.members[0].role if event.members else ""}
    return tuple(values[f] for f in fields)


def assign_advantages(events: list[Event], method: "str | Method", *, scale: str = "std") -> list[Event]:
    """Fill ``event.advantage`` for the method's grouping (a registered name or a :class:`Method`);
    returns the events the loss will see."""
    spec = METHODS[method] if isinstance(method, str) else method
    if spec.per_member:
        events = split_members(events)
    keys: dict[tuple, int] = {}
    group_ids = torch.tensor([keys.setdefault(_key(e, spec.group_by), len(keys)) for e in events], dtype=torch.long)
    rewards = torch.tensor([float(e.reward or 0.0) for e in events], dtype=torch.float64)
    advantages = group_advantages(rewards, group_ids, scale=scale) if events else rewards
    for e, a in zip(events, advantages.tolist()):
        e.advantage = a
    return events


@dataclass(frozen=True)
class UpdateSettings:
    """What the update reads of a run's config, fixed for the run (built once by
    :func:`srpo.build.update_settings`; every value comes from the schema, which holds the defaults).

    Attributes:
        epochs, minibatches, microbatches: ``train.*``: passes over a rollout, optimizer steps per
            pass (event-atomic mini-batches), forward/backward chunks per mini-batch.
        old_logprobs: ``recompute`` (q_old from a no-grad pass) or ``behaviour`` (the sampler's).
        skip_zero_advantage: leave events with a zero advantage out of the forward (no KL term).
        max_grad_norm: the clip of each policy's gradient norm.
        checkpoint_layers: activation checkpointing, ``auto`` resolved for the device.
        adapter_dropout: LoRA dropout acts in the update's forward (``model.lora.dropout`` > 0 under
            the ``lora`` layout): the models train there and evaluate everywhere else.
        loss: the loss's hyperparameters.
    """

    epochs: int
    minibatches: int
    microbatches: int
    old_logprobs: str
    skip_zero_advantage: bool
    max_grad_norm: float
    checkpoint_layers: bool
    adapter_dropout: bool
    loss: LossSettings
