"""Members, events and the event-atomic batch (SRPO.md, "Event-atomic batching").

A *member* is one sampled generation of one role.  An *event* is one state transition and owns
the members (its active set) it consumed.  The update unit of SRPO is the event, so everything
here keeps an event whole: validation drops an incomplete event as a whole (and counts it),
mini-batch splitting and data-parallel sharding never cut one, and both report the global
normaliser the loss must divide by so that the pieces add up to the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from srpo.objective import LOSSES, update_unit


@dataclass
class Member:
    """One sampled output of one role.

    ``completion_ids``, ``action_mask`` and ``behaviour_logprobs`` have one entry per completion
    token; the mask is 0 on tokens the policy did not choose (tool or environment text spliced
    into a multi-turn completion).
    """

    role: str
    policy_id: str
    policy_version: int
    prompt_ids: list[int]
    completion_ids: list[int]
    action_mask: list[int]
    behaviour_logprobs: list[float]
    member_index: int = 0
    text: str = ""
    truncated: bool = False
    temperature: float = 1.0  # the sampling temperature the behaviour log-probs were taken at
    old_logprobs: list[float] | None = None  # recomputed q_old before the update (None: behaviour)

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if len(self.action_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(
                f"member of role {self.role!r}: completion_ids ({n}), action_mask "
                f"({len(self.action_mask)}) and behaviour_logprobs ({len(self.behaviour_logprobs)}) "
                "must have the same length"
            )

    @property
    def num_action_tokens(self) -> int:
        return int(sum(self.action_mask))


@dataclass
class Event:
    """One transition: from the prior state ``prior_state_id`` the workflow sampled ``members``.

    ``expected_size`` is the number of outputs the workflow asked for; an event whose member count
    differs is invalid (a failed or dropped generation) and is never renormalised.
    ``reward`` is the team return seen from this event; ``advantage`` is filled in by the trainer.
    """

    event_id: str
    episode_id: str
    task_id: str
    prior_state_id: str
    event_type: str
    turn: int
    expected_size: int
    members: list[Member] = field(default_factory=list)
    reward: float | None = None
    advantage: float | None = None
    transition_size: int = 0
    """The size K of the active set of the transition this event came from (0: ``size``); member-
    level methods split a K-event into K one-member events, which keep K here for the by-K
    diagnostics."""

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def set_size(self) -> int:
        """K of the transition (``transition_size`` when split, else ``size``)."""
        return self.transition_size or self.size

    @property
    def is_valid(self) -> bool:
        return self.expected_size >= 1 and self.size == self.expected_size

    def count_units(self, unit: str) -> int:
        if unit == "event":
            return 1
        if unit == "member":
            return self.size
        if unit == "token":
            return sum(m.num_action_tokens for m in self.members)
        raise ValueError(f"unknown update unit {unit!r}; valid: event, member, token")


def validate_events(events: list[Event]) -> tuple[list[Event], int]:
    """Keep complete events; return ``(valid, num_dropped)``.  Incomplete events go whole."""
    valid = [e for e in events if e.is_valid]
    return valid, len(events) - len(valid)


def global_normalizer(events: list[Event], loss: str) -> int:
    """How many update units of ``loss`` the events hold (events, members or action tokens)."""
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; valid: {', '.join(LOSSES.names())}")
    unit = update_unit(loss)
    return sum(e.count_units(unit) for e in events)


def _balanced_partition(events: list[Event], parts: int) -> list[list[Event]]:
    """Deterministic greedy partition by token count (largest first), each part in input order.

    Balancing by tokens evens out compute across micro-batches and ranks; the order inside a
    part is the input order so that results do not depend on the partition's bookkeeping.
    """
    if parts < 1:
        raise ValueError(f"number of parts must be >= 1; got {parts}")
    cost = [sum(len(m.prompt_ids) + len(m.completion_ids) for m in e.members) for e in events]
    order = sorted(range(len(events)), key=lambda i: (-cost[i], i))
    load = [0] * parts
    assign: list[list[int]] = [[] for _ in range(parts)]
    for i in order:
        p = min(range(parts), key=lambda q: (load[q], q))
        assign[p].append(i)
        load[p] += cost[i]
    return [[events[i] for i in sorted(idx)] for idx in assign]


def split_minibatches(events: list[Event], num_minibatches: int, loss: str) -> tuple[list[list[Event]], int]:
    """Split into ``num_minibatches`` event-atomic parts; also return the global normaliser."""
    return _balanced_partition(events, num_minibatches), global_normalizer(events, loss)


def shard_events(events: list[Event], rank: int, world: int, loss: str) -> tuple[list[Event], int]:
    """This rank's event-atomic shard of the step's events and the global normaliser.

    Not used by the trainer, which deals *tasks* to ranks before the rollout; the tests' data-
    parallel workers use it to give ranks disjoint shares of one batch.

    Every rank must call it with the same list (same order) to get a disjoint, complete cover.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must lie in [0, {world}); got {rank}")
    return _balanced_partition(events, world)[rank], global_normalizer(events, loss)


@dataclass
class EventBatch:
    """Members of a list of events collated into padded tensors.

    Prompts are left-padded to P and completions right-padded to T so that every completion
    starts at column P:

        input_ids          (M, P + T) long
        attention_mask     (M, P + T) long
        action_mask        (M, T) float, 1 on action tokens
        behaviour_logprobs (M, T) float, 0 off the mask
        old_logprobs       (M, T) float, the recomputed q_old where set, else the behaviour ones
        temperatures       (M,) float, each member's sampling temperature
        event_index        (M,) long in [0, E)
        advantages         (E,) float (0 where the trainer has not set one)
        rewards            (E,) float
        set_sizes          (E,) long
        member_set_sizes   (M,) long, K of the transition each member belongs to (for member-
                           level methods, whose events were split, the K before the split)
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    action_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    old_logprobs: torch.Tensor
    temperatures: torch.Tensor
    event_index: torch.Tensor
    advantages: torch.Tensor
    rewards: torch.Tensor
    set_sizes: torch.Tensor
    member_set_sizes: torch.Tensor
    roles: list[str]
    policy_ids: list[str]
    events: list[Event]

    @property
    def completion_ids(self) -> torch.Tensor:
        """(M, T) the completion tokens."""
        return self.input_ids[:, self.prompt_length:]

    def rows_of_policy(self, policy_id: str) -> torch.Tensor:
        """(m,) long indices of the member rows generated by ``policy_id``."""
        return torch.tensor([i for i, p in enumerate(self.policy_ids) if p == policy_id], dtype=torch.long)

    def to(self, device) -> "EventBatch":
        moved = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()
        }
        return EventBatch(**moved)


def collate(events: list[Event], pad_token_id: int) -> EventBatch:
    """Collate events (all members, in event order) into an :class:`EventBatch`."""
    members = [(e_i, m) for e_i, e in enumerate(events) for m in e.members]
    if not members:
        raise ValueError("cannot collate an empty list of members")
    P = max(len(m.prompt_ids) for _, m in members)
    T = max(max(len(m.completion_ids) for _, m in members), 1)
    # Padded rows are built as Python lists and converted once per tensor: one torch.tensor call
    # per row and field cost more than the whole update on small models.
    ids, attention, mask, behaviour, old = [], [], [], [], []
    for _, m in members:
        p, t = len(m.prompt_ids), len(m.completion_ids)
        pad_left, pad_right = [pad_token_id] * (P - p), [pad_token_id] * (T - t)
        ids.append(pad_left + list(m.prompt_ids) + list(m.completion_ids) + pad_right)
        attention.append([0] * (P - p) + [1] * (p + t) + [0] * (T - t))
        zeros = [0.0] * (T - t)
        mask.append(list(m.action_mask) + zeros)
        behaviour.append(list(m.behaviour_logprobs) + zeros)
        old.append(list(m.old_logprobs if m.old_logprobs is not None else m.behaviour_logprobs) + zeros)
    input_ids = torch.tensor(ids, dtype=torch.long)
    attention = torch.tensor(attention, dtype=torch.long)
    action_mask = torch.tensor(mask, dtype=torch.float32)
    behaviour = torch.tensor(behaviour, dtype=torch.float32) * action_mask
    old = torch.tensor(old, dtype=torch.float32) * action_mask
    return EventBatch(
        input_ids=input_ids,
        attention_mask=attention,
        prompt_length=P,
        action_mask=action_mask,
        behaviour_logprobs=behaviour,
        old_logprobs=old,
        temperatures=torch.tensor([m.temperature if m.temperature > 0 else 1.0 for _, m in members]),
        event_index=torch.tensor([e_i for e_i, _ in members], dtype=torch.long),
        advantages=torch.tensor([e.advantage or 0.0 for e in events], dtype=torch.float32),
        rewards=torch.tensor([e.reward or 0.0 for e in events], dtype=torch.float32),
        set_sizes=torch.tensor([e.size for e in events], dtype=torch.long),
        member_set_sizes=torch.tensor([events[e_i].set_size for e_i, _ in members], dtype=torch.long),
        roles=[m.role for _, m in members],
        policy_ids=[m.policy_id for _, m in members],
        events=list(events),
    )
