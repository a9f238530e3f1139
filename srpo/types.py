"""The types several layers share: how a role is prompted (:class:`RoleSpec`), what an episode
produced (:class:`EpisodeResult`) and its plain form in a checkpoint.

A leaf of the package graph: it imports only the layers below every user of it (events, tasks,
the sampling settings), so the gateway, the workflows, the rollout and the trainer can all name
these types without importing one another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from srpo.events import Event, Member
from srpo.policies.sampling import SamplingParams
from srpo.tasks.base import Task


@dataclass(frozen=True)
class RoleSpec:
    """How one role is prompted and sampled.

    ``template`` formats the user message from the workflow's ``content`` (``{input}``).
    """

    name: str
    system: str = ""
    template: str = "{input}"
    sampling: SamplingParams = SamplingParams()
    tool_parser: str | None = None  # through the gateway: None reads tool calls as the chat template writes them
    reasoning_parser: str | None = None  # through the gateway: None leaves thinking in the content


@dataclass
class EpisodeResult:
    """One finished episode: its task, final answer and reward, and the events (transitions, each
    with its active set of members) it recorded; ``info`` holds counters and failure details,
    ``transcript`` the readable exchange."""

    episode_id: str
    task: Task
    answer: str
    reward: float
    events: list[Event]
    info: dict[str, Any] = field(default_factory=dict)
    transcript: list[str] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(m.completion_ids) for e in self.events for m in e.members)


# -- an episode in a checkpoint (a pending batch) ---------------------------------------------
def episodes_to_plain(episodes: list[EpisodeResult]) -> list[dict[str, Any]]:
    """Episodes as JSON-able dicts (a checkpoint's pending batch)."""
    out = []
    for ep in episodes:
        task = ep.task
        out.append({"episode_id": ep.episode_id, "answer": ep.answer, "reward": ep.reward, "info": ep.info,
                    "transcript": ep.transcript,
                    "task": {"task_id": task.task_id, "question": task.question, "answers": list(task.answers),
                             "kind": task.kind, "source": task.source, "meta": task.meta},
                    "events": [asdict(e) for e in ep.events]})  # members included, as dicts
    return out


def episodes_from_plain(rows: list[dict[str, Any]]) -> list[EpisodeResult]:
    out = []
    for row in rows:
        t = row["task"]
        task = Task(t["task_id"], t["question"], tuple(t["answers"]), t["kind"], t.get("source", ""), t.get("meta", {}))
        events = []
        for e in row["events"]:
            members = [Member(**m) for m in e["members"]]
            events.append(Event(**{k: v for k, v in e.items() if k != "members"}, members=members))
        out.append(EpisodeResult(row["episode_id"], task, row["answer"], row["reward"], events, row["info"],
                                 row["transcript"]))
    return out
