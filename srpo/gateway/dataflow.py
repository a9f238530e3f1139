"""Active sets recovered from data flow: which outputs acted together, found from the calls.

An agent program written against an OpenAI-compatible API never says which outputs form one
transition.  The gateway recovers it from what the program does with them:

1. **Consumption.**  An output is *consumed* by the first later call of the same episode whose
   messages contain its text (whitespace-trimmed).  Only messages that could carry it count: a
   message that already appeared, verbatim, in a call made before the output existed was written
   before it and cannot hold it (so an output "3" is not consumed by a later call that merely
   repeats the question "What is 3 + 0?").
2. **Sets.**  The outputs first consumed by one call are one transition's active set (K = their
   number), recorded as one event, typed ``to:<the consuming call's role>``.
3. **The end.**  Outputs no call consumed are consumed by the episode's end: one final set
   (``final``) — typically the answer the program returns.
4. **Tags override inference.**  A call tagged ``x-srpo-event: <name>`` (header) or
   ``srpo_event`` (request body, ``extra_body`` in the ``openai`` client) puts its outputs in the
   set ``<name>`` of this episode, whatever reads them; tagged outputs are never inferred.  Tag
   each turn's set with its own name (``verify-1``, ``verify-2``).

**Timing never decides.**  Parallel calls arrive in whatever order threads and the network give
them; the sets are computed when the episode ends, from what each call quotes, not from arrival
order.  When several calls could consume an output, the one that comes first *causally* takes it (a
call that quotes another candidate's output, directly or through others, comes after it); among
calls that are causally unordered (parallel), the smallest by (role, message text) does.  Turn
numbers follow the same order, and the members of a set are sorted by (role, text).

**Agents used as tools.**  An output that calls tools is consumed by the first call whose message
*is* one of its arguments (a string value of the arguments' JSON, compared whole): the agent run as
the tool, which gets its own set.  Where no such call exists, the call that receives the tool results
consumes it, as it quotes the arguments.

Where inference and intent can differ (tag these):

- an output quoted only in part (the code extracts a number from a long answer): not seen as
  consumed, it joins the final set;
- an output the code uses for control flow only (a router's choice) or discards: never quoted,
  it joins the final set;
- an empty (or all-whitespace) output: it is in every text, so it is never inferred consumed and
  joins the final set;
- two identical outputs: a call that quotes the text consumes both — right when both were meant
  (parallel workers that agree), wrong when the code passed on only one;
- a tool call whose *result*, not the call, reaches the next agent (AutoGen's group chat passes a
  tool-call summary): the call is never quoted, so it joins the final set;
- an output whose text happens to occur in a later, unrelated message (a short answer such as
  "yes" in a new prompt): consumed there.

Turn numbers count the events of one type within the episode, so (task, event type, turn) groups
the same transition across a task's episodes as the built-in workflows do.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from srpo.events import Event, Member


@dataclass
class RecordedCall:
    """One request of the episode: who asked, and the text of every message it sent."""

    index: int  # arrival order within the episode
    role: str
    texts: list[str]
    outputs_before: int  # how many outputs existed when it arrived
    key: tuple[str, str] = ("", "")  # (role, digest of its messages): orders causally unordered calls

    def __post_init__(self):
        self.key = (self.role, hashlib.sha1("\x1f".join(self.texts).encode()).hexdigest())
        self.last = self.texts[-1].strip() if self.texts else ""  # the message it answers


@dataclass
class RecordedOutput:
    """One completion of the episode, waiting to be placed in a set."""

    index: int  # creation order within the episode
    member: Member
    tag: str | None
    text: str  # what the program received (the answer without its stop string)
    call: int | None  # the index of the call that produced it
    arguments: list[str] = field(default_factory=list)  # its tool calls' raw arguments
    values: list[str] = field(default_factory=list)  # the string values inside those arguments


def _string_values(raw: str) -> list[str]:
    """Every string value in a JSON arguments text (none if it does not parse)."""
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, TypeError):
        return []
    out, stack = [], [data]
    while stack:
        item = stack.pop()
        if isinstance(item, str) and item.strip():
            out.append(item.strip())
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return out


class EpisodeRecorder:
    """The calls of one episode in, its events (active sets) out.

    Call :meth:`before_call` when a request arrives (before it is generated; it returns the call's
    handle), :meth:`record` with each output it produced, and :meth:`finish` once at the episode's end.
    """

    def __init__(self, episode_id: str, task_id: str):
        self.episode_id = episode_id
        self.task_id = task_id
        self.calls: list[RecordedCall] = []
        self.outputs: list[RecordedOutput] = []
        self.events: list[Event] = []
        self.finished = False
        self._first_seen: dict[str, int] = {}  # message text → number of outputs when first seen in a call
        self._type_counts: dict[str, int] = {}

    def _new_event(self, event_type: str) -> Event:
        turn = self._type_counts.get(event_type, 0)
        self._type_counts[event_type] = turn + 1
        n = len(self.events)
        event = Event(event_id=f"{self.episode_id}:{n}", episode_id=self.episode_id, task_id=self.task_id,
                      prior_state_id=f"{self.episode_id}:s{n}", event_type=event_type, turn=turn, expected_size=0)
        self.events.append(event)
        return event

    @staticmethod
    def _fill(event: Event, outputs: list[RecordedOutput]) -> None:
        for out in sorted(outputs, key=lambda o: (o.member.role, o.text, o.index)):
            out.member.member_index = len(event.members)
            event.members.append(out.member)
        event.expected_size = len(event.members)

    def before_call(self, role: str, texts: list[str]) -> int | None:
        """A call of ``role`` with these message texts arrived; returns its handle for :meth:`record`."""
        if self.finished:
            return None
        call = RecordedCall(len(self.calls), role, list(texts), len(self.outputs))
        for t in texts:
            self._first_seen.setdefault(t, len(self.outputs))
        self.calls.append(call)
        return call.index

    def record(self, member: Member, tag: str | None = None, text: str | None = None, *, call: int | None = None,
               arguments: list[str] | None = None) -> None:
        """An output the episode's call ``call`` produced (default: the last call of its role), with
        the call's tag, if any; ``text`` is what the program received, when it differs from the
        member's text; ``arguments``: the raw arguments of the tool calls parsed from it."""
        if self.finished:
            return  # a late answer to an episode that already ended (timed out): not part of it
        if call is None:
            call = next((c.index for c in reversed(self.calls) if c.role == member.role), None)
        arguments = list(arguments or [])
        values = [v for raw in arguments for v in _string_values(raw)]
        self.outputs.append(RecordedOutput(len(self.outputs), member, tag, member.text if text is None else text, call,
                                           arguments, values))

    # -- the sets, once the episode has ended ----------------------------------------------------
    def _quotes(self, out: RecordedOutput, call: RecordedCall) -> bool:
        """Whether ``call`` consumes ``out`` (it arrived after ``out`` existed and carries it)."""
        if call.outputs_before <= out.index:
            return False
        # A message already seen in a call made before this output existed cannot carry it.
        fresh = [t for t in call.texts if t and self._first_seen.get(t, 0) > out.index]
        needles = [n.strip() for n in [out.text, *out.arguments] if n and n.strip()]
        if any(n in t for n in needles for t in fresh):
            return True
        # An agent run as a tool: the message it answers is one of the arguments, whole.
        return bool(call.last) and call.last in out.values

    def _ancestors(self) -> list[set[int]]:
        """For every call, the calls it comes after causally (it quotes their outputs, transitively)."""
        producers = [[o for o in self.outputs if o.call == c.index and o.tag is None] for c in self.calls]
        ancestors: list[set[int]] = []
        for call in self.calls:  # arrival order: a call's ancestors arrived before it
            direct = {p.index for p, outs in zip(self.calls[: call.index], producers)
                      if any(self._quotes(o, call) for o in outs)}
            ancestors.append(set().union(direct, *(ancestors[d] for d in direct)))
        return ancestors

    def finish(self) -> list[Event]:
        """The episode ended: every output placed in its set (tagged, consumed, or final).
        Returns every event."""
        if self.finished:
            return self.events
        self.finished = True
        tagged: dict[str, list[RecordedOutput]] = {}
        for out in self.outputs:
            if out.tag is not None:
                tagged.setdefault(out.tag, []).append(out)
        for tag, outs in tagged.items():
            self._fill(self._new_event(tag), outs)
        ancestors = self._ancestors()
        consumed: dict[int, list[RecordedOutput]] = {}
        rest = []
        for out in self.outputs:
            if out.tag is not None:
                continue
            candidates = [c for c in self.calls if self._quotes(out, c)]
            first = [c for c in candidates if not any(o.index in ancestors[c.index] for o in candidates)]
            if first:
                consumer = min(first, key=lambda c: c.key)
                consumed.setdefault(consumer.index, []).append(out)
            else:
                rest.append(out)
        depth = [len(a) for a in ancestors]
        for index in sorted(consumed, key=lambda i: (depth[i], self.calls[i].key)):
            self._fill(self._new_event(f"to:{self.calls[index].role}"), consumed[index])
        if rest:
            self._fill(self._new_event("final"), rest)
        return self.events
