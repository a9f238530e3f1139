"""The types several layers share: the messages between a workflow and a rollout engine (how to
sample, :class:`SamplingParams`; what to sample, :class:`GenerationRequest`; what was sampled,
:class:`Sample`), how a role is prompted (:class:`RoleSpec`), what an episode produced
(:class:`EpisodeResult`) and its plain form in a checkpoint.

A leaf of the package graph with no torch import: it imports only ``srpo.tasks.base`` (and
``srpo.events`` when a checkpoint's plain form is read back), so the gateway, the workflows, the
rollout and the trainer can all name these types without importing one another.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from srpo.config import DEFAULT_MAX_NEW_TOKENS
from srpo.tasks.base import Task

if TYPE_CHECKING:
    from srpo.events import Event


@dataclass(frozen=True)
class Grammar:
    """The form a reply must take (structured output): JSON that ``schema`` (a JSON Schema, as JSON
    text) accepts — ``{"type": "object"}`` for OpenAI's ``json_object``.  Engines enforce it by
    constrained decoding (:mod:`srpo.policies.grammar`; vLLM's structured outputs)."""

    schema: str
    name: str = ""  # the schema's name in the request (json_schema.name), for messages
    #: non-empty: a tool call is allowed instead — text that begins with this (the start of a call
    #: in the role's tool format), free after it; the request offered tools as well
    or_call: str = ""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    #: the reply's required form; its tokens are drawn from the model's distribution masked to what
    #: the grammar allows, and their behaviour log-probs are of that masked distribution
    grammar: Grammar | None = None
    #: called with each token id as it is drawn, in the sampling thread (streamed replies: srpo's
    #: sampler and the vLLM engine call it; an engine that does not leaves the reply whole)
    on_token: Callable[[int], None] | None = field(default=None, compare=False, repr=False)
    #: record each drawn token's behaviour log-prob (training needs them); False where nothing reads
    #: them (``srpo serve``): an engine may then skip them — vLLM's sampler otherwise forms a log-softmax
    #: over the vocabulary and ranks the drawn token in it every step, and its front builds an object
    #: per token (on a CPU no gain was measurable: benchmarks/README.md, section 22) — and the
    #: sample's ``logprobs`` may be empty
    logprobs: bool = True

    def __post_init__(self):
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.max_new_tokens < 1:
            raise ValueError(
                f"invalid sampling settings {self}: temperature ≥ 0, 0 < top_p ≤ 1, max_new_tokens ≥ 1"
            )


@dataclass
class GenerationRequest:
    """One completion to sample: the role asking, its prompt's token ids, how to sample."""

    role: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class Sample:
    """One completion: token ids, decoded text, behaviour log-probs (one per token), and why it ended."""

    completion_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "eos" | "stop" | "length"
    #: the version of the weights it was drawn with (set by the runtime as it samples: a member
    #: records this, not the version when its episode reads the sample — weights may move between)
    policy_version: int | None = None

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


def drawn_version(sample: Sample, policies, policy_id: str) -> int:
    """The version of ``policy_id``'s weights ``sample`` was drawn with (the runtime records it as
    it samples; a sample from elsewhere: the version now)."""
    return sample.policy_version if sample.policy_version is not None else policies.version(policy_id)


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
def task_to_plain(task: Task) -> dict[str, Any]:
    return {"task_id": task.task_id, "question": task.question, "answers": list(task.answers), "kind": task.kind,
            "source": task.source, "meta": task.meta}


def task_from_plain(t: dict[str, Any]) -> Task:
    return Task(t["task_id"], t["question"], tuple(t["answers"]), t["kind"], t.get("source", ""), t.get("meta", {}))


def episodes_to_plain(episodes: list[EpisodeResult]) -> list[dict[str, Any]]:
    """Episodes as JSON-able dicts (a checkpoint's pending batch)."""
    return [{"episode_id": ep.episode_id, "answer": ep.answer, "reward": ep.reward, "info": ep.info,
             "transcript": ep.transcript, "task": task_to_plain(ep.task),
             "events": [asdict(e) for e in ep.events]}  # members included, as dicts
            for ep in episodes]


def episodes_from_plain(rows: list[dict[str, Any]]) -> list[EpisodeResult]:
    from srpo.events import Event, Member  # here, not at the top: the events module imports torch

    out = []
    for row in rows:
        task = task_from_plain(row["task"])
        events = []
        for e in row["events"]:
            members = [Member(**m) for m in e["members"]]
            events.append(Event(**{k: v for k, v in e.items() if k != "members"}, members=members))
        out.append(EpisodeResult(row["episode_id"], task, row["answer"], row["reward"], events, row["info"],
                                 row["transcript"]))
    return out
