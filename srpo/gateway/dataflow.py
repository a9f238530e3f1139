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

Where inference and intent can differ (tag these):

- an output quoted only in part (the code extracts a number from a long answer): not seen as
  consumed, it joins the final set;
- an output the code uses for control flow only (a router's choice) or discards: never quoted,
  it joins the final set;
- an empty (or all-whitespace) output: it is in every text, so it is never inferred consumed and
  joins the final set;
- two identical outputs: a call that quotes the text consumes both — right when both were meant
  (parallel workers that agree), wrong when the code passed on only one;
- an output whose text happens to occur in a later, unrelated message (a short answer such as
  "yes" in a new prompt): consumed there.

Turn numbers count the events of one type within the episode, so (task, event type, turn) groups
the same transition across a task's episodes as the built-in workflows do.
"""

from __future__ import annotations

from dataclasses import dataclass

from srpo.events import Event, Member


@dataclass
class RecordedOutput:
    """One completion of the episode, waiting to be placed in a set."""

    index: int  # creation order within the episode
    member: Member
    tag: str | None
    text: str  # what the program received (the answer without its stop string, or a tool call's arguments)
    consumed: bool = False


class EpisodeRecorder:
    """The calls of one episode in, its events (active sets) out.

    Call :meth:`before_call` when a request arrives (before it is generated), :meth:`record` with
    each output it produced, and :meth:`finish` once at the episode's end.
    """

    def __init__(self, episode_id: str, task_id: str):
        self.episode_id = episode_id
        self.task_id = task_id
        self.outputs: list[RecordedOutput] = []
        self.events: list[Event] = []
        self.finished = False
        self._first_seen: dict[str, int] = {}  # message text → number of outputs when first seen in a call
        self._tagged: dict[str, Event] = {}
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
    def _add(event: Event, member: Member) -> None:
        member.member_index = len(event.members)
        event.members.append(member)
        event.expected_size = len(event.members)

    def before_call(self, role: str, texts: list[str]) -> Event | None:
        """A call of ``role`` with these message texts arrived: the outputs it consumes become one
        event (returned; None when it consumes none)."""
        if self.finished:
            return None
        now = len(self.outputs)
        consumed = []
        for out in self.outputs:
            if out.consumed or out.tag is not None:
                continue
            needle = out.text.strip()
            # A message already seen in a call made before this output existed cannot carry it.
            if needle and any(needle in t for t in texts if t and self._first_seen.get(t, now) > out.index):
                consumed.append(out)
        for t in texts:
            self._first_seen.setdefault(t, len(self.outputs))
        if not consumed:
            return None
        event = self._new_event(f"to:{role}")
        for out in consumed:
            out.consumed = True
            self._add(event, out.member)
        return event

    def record(self, member: Member, tag: str | None = None, text: str | None = None) -> None:
        """An output the episode's call produced (with the call's tag, if any); ``text`` is what the
        program received, when it differs from the member's text."""
        if self.finished:
            return  # a late answer to an episode that already ended (timed out): not part of it
        out = RecordedOutput(len(self.outputs), member, tag, member.text if text is None else text)
        self.outputs.append(out)
        if tag is not None:
            event = self._tagged.get(tag)
            if event is None:
                event = self._tagged[tag] = self._new_event(tag)
            self._add(event, member)
            out.consumed = True

    def finish(self) -> list[Event]:
        """The episode ended: unconsumed outputs form the final set.  Returns every event."""
        if not self.finished:
            self.finished = True
            rest = [o for o in self.outputs if not o.consumed]
            if rest:
                event = self._new_event("final")
                for out in rest:
                    out.consumed = True
                    self._add(event, out.member)
        return self.events
