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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo.events import Event
from srpo.objective import group_advantages


@dataclass(frozen=True)
class Method:
    loss: str
    group_by: tuple[str, ...]  # fields of (task, event_type, turn, role)
    per_member: bool = False


METHODS = {
    "srpo": Method("srpo", ("task", "event_type", "turn")),
    "grpo": Method("grpo", ("task", "event_type", "turn")),
    "gspo": Method("gspo", ("task", "event_type", "turn")),
    "dr_mas": Method("grpo", ("task", "role"), per_member=True),
    "at_grpo": Method("grpo", ("task", "role", "turn"), per_member=True),
}


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


def assign_advantages(events: list[Event], method: str, *, scale: str = "std") -> list[Event]:
    """Fill ``event.advantage`` for the method's grouping; returns the events the loss will see."""
    spec = METHODS[method]
    if spec.per_member:
        events = split_members(events)
    keys: dict[tuple, int] = {}
    group_ids = torch.tensor([keys.setdefault(_key(e, spec.group_by), len(keys)) for e in events], dtype=torch.long)
    rewards = torch.tensor([float(e.reward or 0.0) for e in events], dtype=torch.float64)
    advantages = group_advantages(rewards, group_ids, scale=scale) if events else rewards
    for e, a in zip(events, advantages.tolist()):
        e.advantage = a
    return events
